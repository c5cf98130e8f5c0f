"""Block sharing on SmolLM2: prefix caching does not change output (on vs off, stop string
mid-block, prompts of whole blocks), cache_salt isolation, generated blocks cached for the
next turn, and parallel sampling (n=4) that shares the prompt's blocks."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.integration.prompts import PROMPTS

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm_off(smollm2_gguf):
    return LLM(smollm2_gguf, enable_prefix_caching=False, kv_cache_space=0.25)


@pytest.fixture(scope="module")
def long_ids(smollm2_llm):
    ids = smollm2_llm.get_tokenizer().encode(PROMPTS[-1])
    assert len(ids) > 512
    return ids


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_prefix_caching_on_equals_off(smollm2_llm, llm_off, long_ids):
    prompts = [
        {"prompt_token_ids": long_ids[:32]},  # exactly two blocks
        {"prompt_token_ids": long_ids[:64]},  # four blocks, the first two shared with the above
        PROMPTS[2],  # stops at "Grape", in the middle of its second block
        PROMPTS[-1],  # 33 blocks, shares its start with the first two
        PROMPTS[-1] + " Be brief.",  # shares 32 full blocks with the one above
    ]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=40, stop=["Grape"]),
              GREEDY, GREEDY]
    off = llm_off.generate(prompts, params, use_tqdm=False)
    assert smollm2_llm.reset_prefix_cache()
    before = smollm2_llm.kv_cache_stats().prefix_cache_hits
    first = smollm2_llm.generate(prompts, params, use_tqdm=False)
    second = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert tokens(first) == tokens(off) == tokens(second)
    assert [o.outputs[0].text for o in first] == [o.outputs[0].text for o in off]
    fruit = first[2].outputs[0]
    assert fruit.finish_reason == "stop" and fruit.stop_reason == "Grape"
    assert fruit.text.endswith("3. ") and (len(first[2].prompt_token_ids) + len(fruit.token_ids)) % 16

    # First run: prompts submitted together wait a step for a prefix another one is computing,
    # then hit it. Second run: every full block of every prompt but the last token's is hit.
    assert [o.num_cached_tokens for o in first] == [0, 32, 0, 64, 512]
    assert [o.num_cached_tokens for o in second] == [16, 48, 0, 512, 512]
    hits = smollm2_llm.kv_cache_stats().prefix_cache_hits - before
    assert hits == sum(o.num_cached_tokens for o in first + second)
    stats = llm_off.kv_cache_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert all(o.num_cached_tokens == 0 for o in off)


def test_generated_blocks_serve_the_next_turn(smollm2_llm, long_ids):
    out = smollm2_llm.generate({"prompt_token_ids": long_ids}, GREEDY, use_tqdm=False)[0]
    history = long_ids + out.outputs[0].token_ids  # 548 tokens, 547 computed: 34 full blocks
    follow = smollm2_llm.generate({"prompt_token_ids": history + [28, 4930]}, GREEDY,
                                  use_tqdm=False)[0]
    assert follow.num_cached_tokens == 34 * 16 > 512


def test_cache_salt_isolates(smollm2_llm, llm_off, long_ids):
    salted = [{"prompt_token_ids": long_ids, "cache_salt": s} for s in ("alice", "bob", "alice")]
    assert smollm2_llm.reset_prefix_cache()
    outs = [smollm2_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in salted]
    plain = smollm2_llm.generate({"prompt_token_ids": long_ids}, GREEDY, use_tqdm=False)[0]
    assert [o.num_cached_tokens for o in outs + [plain]] == [0, 0, 512, 0]
    ref = llm_off.generate({"prompt_token_ids": long_ids}, GREEDY, use_tqdm=False)[0]
    assert tokens(outs + [plain]) == tokens([ref] * 4)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        smollm2_llm.generate({"prompt": "hi", "cache_salt": ""}, GREEDY, use_tqdm=False)


def test_reset_prefix_cache_forgets_hits(smollm2_llm, long_ids):
    smollm2_llm.generate({"prompt_token_ids": long_ids}, GREEDY, use_tqdm=False)
    assert smollm2_llm.reset_prefix_cache()
    out = smollm2_llm.generate({"prompt_token_ids": long_ids}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_n4_greedy_gives_four_equal_samples_sharing_the_prompt(smollm2_llm, long_ids):
    assert smollm2_llm.reset_prefix_cache()
    smollm2_llm.llm_engine.reset_kv_cache_peak()
    out = smollm2_llm.generate({"prompt_token_ids": long_ids},
                               SamplingParams(n=4, temperature=0.0, max_tokens=16),
                               use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len(samples) == 4 and all(s == samples[0] for s in samples)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    stats = smollm2_llm.kv_cache_stats()
    # 524 + 16 tokens: 34 blocks a sample unshared (136); shared: 32 full prompt blocks once,
    # then each sample's own copy of the partial block 32 and its block 33.
    assert stats.peak_shared_blocks >= 32
    assert stats.peak_used_blocks <= 32 + 4 * 2 < 4 * 34
    assert stats.used_blocks == 0 and stats.shared_blocks == 0


def test_seeded_n4_is_reproducible_in_any_batch(smollm2_llm):
    params = SamplingParams(n=4, temperature=0.9, seed=1234, max_tokens=20)
    alone = smollm2_llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    mixed = smollm2_llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[5]],
                                 [GREEDY, params, SamplingParams(n=2, temperature=0.9)],
                                 use_tqdm=False)[1]
    assert tokens([alone]) == tokens([mixed])
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # samples differ
    # Sample 0 draws with the request's own seed: it equals an n=1 request with that seed.
    single = smollm2_llm.generate(
        PROMPTS[3], SamplingParams(temperature=0.9, seed=1234, max_tokens=20), use_tqdm=False)
    assert single[0].outputs[0].token_ids == alone.outputs[0].token_ids
