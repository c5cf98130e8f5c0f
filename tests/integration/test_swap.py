"""Preemption by swap and by recompute give the same output as no preemption, for parallel
samples (n=3, seeded), beam search and single greedy sequences side by side."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from tests.integration.prompts import PROMPTS

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SAMPLED = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
BEAMS = BeamSearchParams(beam_width=3, max_tokens=14)
PARAMS = [SAMPLED, GREEDY, SAMPLED, GREEDY]


def run(llm):
    mixed = llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)
    beams = llm.beam_search(PROMPTS[:3], BEAMS, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in mixed + beams]


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    return run(smollm2_llm)


@pytest.mark.parametrize("mode", [None, "swap", "recompute"])
def test_preemption_modes_give_the_same_output(smollm2_gguf, reference, mode):
    # 10 blocks of 16: each request fits alone, but not all together: preemptions are certain.
    llm = LLM(smollm2_gguf, num_kv_blocks=10, preemption_mode=mode, swap_space=0.05,
              enable_prefix_caching=False)
    assert run(llm) == reference
    stats = llm.kv_cache_stats()
    assert stats.num_preemptions > 0
    if mode == "recompute":
        assert stats.num_swapped_out == 0 == stats.num_swapped_in
    else:  # the default swaps the forked groups (n=3 samples, beams) and recomputes singles
        assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    kv = llm.llm_engine.kv_cache_manager
    assert stats.used_blocks == 0 and kv.num_free_host_blocks == llm.llm_engine.num_host_blocks
    kv.check_invariants([])
    # The runner's sampling rows survived every preemption (same seeded draws) and leave with
    # their sequences: the finished ones are dropped at the next step.
    llm.llm_engine.core.step()
    assert len(llm.llm_engine.model_runner.input_batch) == 0


def test_swap_needs_swap_space(smollm2_gguf):
    with pytest.raises(ValueError, match="preemption_mode='swap' needs swap_space > 0"):
        LLM(smollm2_gguf, preemption_mode="swap", swap_space=0)
