"""Speculative decoding with n-gram proposals on SmolLM2 (issue 26): greedy output equals the
plain engine's token for token, at batch sizes 1 and 8, under preemption, with prefix
caching, with n > 1 and max_tokens / EOS inside a proposal; the block invariants hold after
every step; proposals were made and accepted (else the equality would say nothing)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [
    f"Copy this code exactly:\n{CODE}\nCopy:\n",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,",
    "Repeat after me: the quick brown fox jumps over the lazy dog. Again: the quick brown",
    "A list of colours: red, green, blue, red, green, blue, red,",
    f"{CODE}\n# the same functions again\n",
    "Hello! How are you today? Hello! How are",
    "Once upon a time there was a little girl. Once upon a time there was a",
]


def run_checked(llm: LLM, prompts, params) -> list:
    """generate() with the KV invariants checked after every step."""
    core = llm.llm_engine.core
    step = core.step

    def checked_step():
        out = step()
        active = [s for st in core.requests.values() for s in st.seqs if not s.is_finished]
        core.kv_cache_manager.check_invariants(active)
        return out

    core.step = checked_step
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.step = step


@pytest.fixture(scope="module")
def plain(smollm2_llm):
    """The reference: the run's shared plain engine (greedy output does not depend on its pool)."""
    return smollm2_llm


@pytest.fixture(scope="module")
def spec():
    return LLM(max_model_len=1024, num_kv_blocks=512, speculative_config=SPEC)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equals_plain(plain, spec, batch):
    params = SamplingParams(temperature=0.0, max_tokens=48)
    prompts = PROMPTS[1:batch + 1]  # the first (copy a code block) is answered, not copied
    ours = run_checked(spec, prompts, params)
    assert _tokens(ours) == _tokens(plain.generate(prompts, params, use_tqdm=False))
    stats = spec.llm_engine.core.speculation.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_greedy_equals_plain_with_preemption_prefix_hits_and_n():
    params = [SamplingParams(temperature=0.0, max_tokens=64, n=2), SamplingParams(temperature=0.0, max_tokens=5)]
    prompts = PROMPTS[:8]
    kw = dict(max_model_len=1024, num_kv_blocks=40, max_num_batched_tokens=256)
    want = _tokens(LLM(**kw).generate(prompts * 2, [params[i % 2] for i in range(16)], use_tqdm=False))
    llm = LLM(**kw, speculative_config=SPEC)
    got = _tokens(run_checked(llm, prompts * 2, [params[i % 2] for i in range(16)]))
    assert got == want
    stats = llm.kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.llm_engine.core.speculation.stats.num_accepted_tokens > 0
    assert stats.used_blocks == 0
