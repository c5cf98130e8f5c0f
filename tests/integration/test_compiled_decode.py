"""Compiled decode steps (torch.compile per padded batch size) give the same tokens as eager.

A tiny random Llama checkpoint keeps compilation short; the graphs are the same code path as for
SmolLM2 (whole model + LM head, the attention op opaque, padded rows on the scratch block).
transformers' greedy output is stored (tests/references.py); the Llama family's live check is
test_engine_parity.py::test_chat_api_matches_transformers.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.integration.test_tiny_models import _save_tiny, _tokenizer
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPTS = [
    "Hello there, how are",
    "The quick brown fox",
    "1, 2, 3, 4,",
    "A much longer prompt that spans more than one block of eight tokens for sure.",
    "Short",
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = _tokenizer(smollm2_gguf)
    hf_model = _save_tiny("llama", path, tok)
    return str(path), hf_model, tok


@pytest.fixture(scope="module")
def compiled_llm(tiny_llama):
    llm = LLM(tiny_llama[0], kv_cache_space=0.05, block_size=8, max_num_seqs=4,
              enforce_eager=False, compile_batch_sizes=[1, 4])
    runner = llm.llm_engine.model_runner
    assert runner.wait_for_compilation(timeout=900), runner.decode_graphs._failed
    return llm


def test_compiled_greedy_matches_eager_and_transformers(tiny_llama, compiled_llm):
    path, hf_model, tok = tiny_llama
    graphs = compiled_llm.llm_engine.model_runner.decode_graphs
    # Different lengths, so that batches of 3 and 2 (padded to 4) and of 1 occur.
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (20, 14, 20, 8, 20)]
    before, padded_before = graphs.steps_run, graphs.padded_rows
    compiled = compiled_llm.generate(PROMPTS, params, use_tqdm=False)
    assert graphs.steps_run - before > 10
    assert graphs.padded_rows > padded_before
    eager = LLM(path, kv_cache_space=0.05, block_size=8, max_num_seqs=4, enforce_eager=True)
    assert eager.llm_engine.model_runner.decode_graphs is None
    eager_outs = eager.generate(PROMPTS, params, use_tqdm=False)

    def hf_generate(prompt_ids):
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                    do_sample=False, pad_token_id=tok.eos_token_id)
        return ref[0, ids.shape[1]:].tolist()

    prompt_ids = [list(c.prompt_token_ids) for c in compiled]
    refs = reference("compiled_decode.greedy", lambda: [hf_generate(ids) for ids in prompt_ids], sources=[path],
                     inputs={"prompts": prompt_ids, "max_new": 20, "pad": tok.eos_token_id})
    for c, e, ref in zip(compiled, eager_outs, refs, strict=True):
        assert c.outputs[0].token_ids == e.outputs[0].token_ids, c.prompt
        got = c.outputs[0].token_ids
        assert got == ref[: len(got)], c.prompt


def test_compiled_logprobs_match_eager(tiny_llama, compiled_llm):
    """Sampling reads the compiled graph's logits: their log-probabilities equal eager's."""
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    compiled = compiled_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    eager = LLM(tiny_llama[0], kv_cache_space=0.05, block_size=8, max_num_seqs=4, enforce_eager=True)
    for c, e in zip(compiled, eager.generate(PROMPTS[:4], params, use_tqdm=False)):
        for lc, le in zip(c.outputs[0].logprobs, e.outputs[0].logprobs):
            assert lc.keys() == le.keys()
            for tid in lc:
                assert abs(lc[tid].logprob - le[tid].logprob) < 1e-4


def test_sampled_and_prompt_logprob_steps_run_eager_correctly(compiled_llm):
    """Steps that need every prompt row's logits (prompt_logprobs) stay eager; mixed with
    compiled decode steps of other requests, outputs are complete."""
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1)]
    outs = compiled_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12
    assert outs[1].prompt_logprobs is not None and len(outs[1].prompt_logprobs) == len(outs[1].prompt_token_ids)


def test_compile_batch_sizes_are_validated():
    with pytest.raises(ValueError, match="compile_batch_sizes"):
        LLM(compile_batch_sizes=[0, 4])
