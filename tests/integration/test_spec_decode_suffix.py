"""Suffix decoding on SmolLM2: greedy output equals the plain engine's token for token, for a
batch of prompts that repeat text and again for a second round that the global tree (round
one's outputs) serves; under preemption with n = 2 and an abort. The KV invariants hold
after every step, proposals were accepted (the global tree's too), and no per-sequence state
is left once the requests are gone."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.integration.test_spec_decode import PROMPTS, _tokens, run_checked

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SPEC = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def plain(smollm2_llm):
    """The reference: the run's shared plain engine (greedy output does not depend on its pool)."""
    return smollm2_llm


@pytest.fixture(scope="module")
def suffix():
    return LLM(max_model_len=1024, num_kv_blocks=512, speculative_config=SPEC)


def _counts(llm: LLM) -> tuple[int, int, int, int]:
    core = llm.llm_engine.core
    s = core.speculation.stats
    return s.num_draft_tokens, s.num_accepted_tokens, core.speculation.proposer.num_local_drafts, core.speculation.proposer.num_global_drafts


def test_greedy_equals_plain_then_the_global_tree_serves_round_two(plain, suffix):
    prompts = PROMPTS[1:7]
    want = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert _tokens(run_checked(suffix, prompts, GREEDY)) == want
    drafted, accepted, local, glob = _counts(suffix)
    assert drafted > 0 and accepted > 0 and local > 0
    proposer = suffix.llm_engine.core.speculation.proposer
    assert proposer.num_active == 0 and not proposer.cache.local  # nothing left per sequence
    assert len(proposer.cache.cached) == len(prompts)  # their outputs stay in the global tree
    # Round two asks the same again: the answers are in the global tree.
    assert _tokens(run_checked(suffix, prompts, GREEDY)) == want
    drafted2, accepted2, _, glob2 = _counts(suffix)
    rate1, rate2 = accepted / drafted, (accepted2 - accepted) / (drafted2 - drafted)
    print(f"suffix acceptance: round 1 {accepted}/{drafted} = {rate1:.2f}, "
          f"round 2 {accepted2 - accepted}/{drafted2 - drafted} = {rate2:.2f}; "
          f"global-tree drafts {glob} then {glob2 - glob}")
    assert glob2 - glob > glob and rate2 > rate1 and rate2 > 0.6
    assert proposer.num_active == 0 and len(proposer.cache.cached) == 2 * len(prompts)


def test_greedy_equals_plain_under_preemption_with_n_and_an_abort():
    params = [SamplingParams(temperature=0.0, max_tokens=40, n=2), SamplingParams(temperature=0.0, max_tokens=6)]
    prompts = PROMPTS[:6]
    kw = dict(max_model_len=1024, num_kv_blocks=20, max_num_batched_tokens=256)
    want = _tokens(LLM(**kw).generate(prompts, [params[i % 2] for i in range(6)], use_tqdm=False))
    llm = LLM(**kw, speculative_config=SPEC)
    got = _tokens(run_checked(llm, prompts, [params[i % 2] for i in range(6)]))
    assert got == want
    stats = llm.kv_cache_stats()
    core = llm.llm_engine.core
    assert stats.num_preemptions > 0 and core.speculation.stats.num_accepted_tokens > 0
    assert core.speculation.proposer.num_active == 0 and stats.used_blocks == 0
    # An abort mid-way leaves nothing behind either.
    engine = llm.llm_engine
    engine.add_request("gone", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=64, n=2))
    engine.add_request("stays", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=16))
    for _ in range(50):  # until both samples of "gone" and "stays" were proposed for
        if core.speculation.proposer.num_active == 3:
            break
        engine.step()
    engine.abort_request("gone")
    assert core.speculation.proposer.num_active == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert core.speculation.proposer.num_active == 0 and not core.speculation.proposer.cache.local
    assert llm.kv_cache_stats().used_blocks == 0
