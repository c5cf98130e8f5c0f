"""Invariant 4: a request's greedy output does not depend on its batch, chunking, preemption,
block size or prefix caching."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.integration.prompts import PROMPTS, batch_prompts

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def texts(outs):
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    """Each of PROMPTS run alone on the default engine (block 16, big pool, chunked 2048)."""
    return [smollm2_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in PROMPTS]


def test_batch_of_32_equals_alone(smollm2_llm):
    prompts = batch_prompts(32)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    together = smollm2_llm.generate(prompts, params, use_tqdm=False)
    alone = [smollm2_llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [o.request_id for o in together] == sorted(
        [o.request_id for o in together], key=lambda r: int(r.split("-")[1]))
    assert texts(together) == texts(alone)
    assert smollm2_llm.kv_cache_stats().used_blocks == 0


def test_chunked_prefill_small_budget(smollm2_gguf, reference):
    llm = LLM(smollm2_gguf, max_num_batched_tokens=24, max_num_seqs=8, kv_cache_space=0.5,
              enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_preemption_by_recompute(smollm2_gguf, reference):
    # The 7 short prompts + 32 new tokens need ~3 blocks of 16 each, ~21 in all; a pool of 10
    # admits them all at first, then forces preemptions as they grow; each alone fits.
    llm = LLM(smollm2_gguf, num_kv_blocks=10, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS[:7], GREEDY, use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference[:7]
    assert stats.used_blocks == 0 and stats.peak_used_blocks <= 10


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes(smollm2_gguf, reference, block_size):
    llm = LLM(smollm2_gguf, block_size=block_size, kv_cache_space=0.5)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.kv_cache_stats()
    assert stats.block_size == block_size and stats.used_blocks == 0
    assert stats.peak_tokens_stored <= stats.peak_used_blocks * block_size


def test_prefix_caching_does_not_change_output(smollm2_llm, reference):
    # Run twice: the second run hits the prefix cache for every full prompt block.
    smollm2_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = smollm2_llm.kv_cache_stats().prefix_cache_hits
    outs = smollm2_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert smollm2_llm.kv_cache_stats().prefix_cache_hits > before
    assert [o.outputs[0].token_ids for o in outs] == reference
