"""Pooling requests are requests of the one engine core: the generation scheduler admits them,
the block manager gives a decoder's prompt its KV blocks (chunk by chunk under chunked
prefill) and takes them back when the request finishes with its vector; an encoder's prompts
are scheduled whole over bookkeeping blocks that return the same way. The runner reads only
the step plan, whose sequences say `pool`."""

from __future__ import annotations

import pytest
import torch

from tests.integration.pooling_fixtures import save_decoder_embedder, save_encoder

pytestmark = pytest.mark.slow  # builds models

TEXTS = ["the capital of france is paris and the river of the city is long",
         "a cat and a dog in the house", "what is the memory cache of the engine"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling-core")
    save_decoder_embedder(root / "qwen3", "qwen3", seed=7)
    save_encoder(root / "bert", seed=8)
    return root


def _run_watching(llm, texts):
    """Submit prepared requests, step the one engine to the end; the plans the runner got and,
    after each step, the blocks the pool had in use."""
    from pagedllm.pooling.params import PoolingParams

    engine = llm.llm_engine
    core = engine.core
    plans, used = [], []
    execute = core.executor.execute_model

    def spy(plan):
        plans.append(plan)
        return execute(plan)

    core.executor.execute_model = spy
    prepared = engine.pooling_inputs.prepare_many([f"r{i}" for i in range(len(texts))], texts, PoolingParams())
    for params, work in prepared:
        engine.add_pooling_request(params, work)
    assert core.scheduler.num_waiting == len(texts)  # the one scheduler holds them
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        used.append(core.kv_cache_manager.num_blocks - core.kv_cache_manager.num_free_blocks)
    core.executor.execute_model = execute
    return [outs[f"r{i}"] for i in range(len(texts))], plans, used


def test_decoder_prompts_take_and_return_kv_blocks_chunk_by_chunk(folders):
    from pagedllm import LLM

    llm = LLM(str(folders / "qwen3"), runner="pooling", num_kv_blocks=32, block_size=8,
              enable_chunked_prefill=True, max_num_batched_tokens=8, enable_prefix_caching=False)
    core = llm.llm_engine.core
    assert core.pooling is not None and core.scheduler.config.enable_chunked_prefill
    outs, plans, used = _run_watching(llm, TEXTS)
    steps = [s for p in plans for s in p.sequences]
    assert steps and all(s.pool for s in steps)
    assert max(p.num_batched_tokens for p in plans) <= 8  # the one token budget
    assert any(s.start_pos > 0 for s in steps)  # chunked: a prompt ran over several steps
    assert max(used) > 0 and used[-1] == 0  # the prompts held blocks, and gave them all back
    assert core.kv_cache_manager.num_free_blocks == 32 and not core.requests
    whole = llm.embed(TEXTS, use_tqdm=False)  # one chunk each: the same vectors
    for a, b in zip(outs, whole):
        assert torch.allclose(a.outputs.data, torch.tensor(b.outputs.embedding), atol=1e-5)


def test_encoder_prompts_are_scheduled_whole_and_their_blocks_return(folders):
    from pagedllm import LLM

    llm = LLM(str(folders / "bert"), max_num_batched_tokens=130, max_num_seqs=2)
    core = llm.llm_engine.core
    assert core.pooling.is_encoder and not core.scheduler.config.enable_chunked_prefill
    outs, plans, used = _run_watching(llm, TEXTS)
    steps = [s for p in plans for s in p.sequences]
    assert len(steps) == len(TEXTS) and all(s.pool and s.start_pos == 0 and s.sample for s in steps)
    assert max(len(p.sequences) for p in plans) <= 2  # max_num_seqs holds for encoders too
    assert used[-1] == 0 and core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert all(o.outputs.data.shape == (64,) for o in outs)


def test_generation_request_to_a_pooling_core_is_refused_by_the_core(folders):
    from pagedllm import LLM
    from pagedllm.engine.core_messages import EngineCoreRequest
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(str(folders / "qwen3"), runner="pooling", num_kv_blocks=16)
    with pytest.raises(ValueError, match="pooling model: it does not serve generation requests"):
        llm.llm_engine.core.add_request(EngineCoreRequest("g", [1, 2], SamplingParams(), 0.0))
    assert not llm.llm_engine.core.requests
