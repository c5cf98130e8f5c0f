"""Speculative decoding with a draft model (issue 26) on SmolLM2: greedy output equals the plain
engine's token for token with SmolLM2 as its own draft (nearly every draft accepted) and with a
tiny random draft of SmolLM2's vocabulary (nearly none), under preemption by recompute and by
swap, with prefix-cache hits and n > 1; the block invariants hold after every step; the draft's
K/V takes its share of every block; what is not built is refused by name."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model_source import default_model_path
from tests.integration.model_fixtures import make_hf_model, save_checkpoint, tiny_config
from tests.integration.test_spec_decode import PROMPTS, _tokens, run_checked

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's vocabulary: a draft whose guesses are mostly wrong."""
    path = tmp_path_factory.mktemp("random-draft")
    save_checkpoint(make_hf_model(tiny_config("llama", vocab_size=SMOLLM2_VOCAB, max_position_embeddings=2048)),
                    path)
    return str(path)


@pytest.fixture(scope="module")
def plain(smollm2_llm):
    """The reference: the run's shared plain engine (greedy output does not depend on its pool)."""
    return smollm2_llm


def test_smollm2_as_its_own_draft_equals_plain_and_accepts_nearly_all(plain):
    spec = {"model": str(default_model_path()), "num_speculative_tokens": 4}
    llm = LLM(max_model_len=1024, num_kv_blocks=512, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = PROMPTS[:4]
    assert _tokens(run_checked(llm, prompts, params)) == _tokens(plain.generate(prompts, params, use_tqdm=False))
    stats = llm.llm_engine.core.speculation.stats
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0.9, vars(stats)
    assert llm.kv_cache_stats().used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_random_draft_under_preemption_prefix_hits_and_n_equals_plain(plain, random_draft, mode):
    params = [SamplingParams(temperature=0.0, max_tokens=32, n=2), SamplingParams(temperature=0.0, max_tokens=5)]
    prompts = PROMPTS[2:6] * 2  # the repeats hit the prefix cache
    per_prompt = [params[i % 2] for i in range(len(prompts))]
    want = _tokens(plain.generate(prompts, per_prompt, use_tqdm=False))
    kw = dict(max_model_len=1024, num_kv_blocks=16, max_num_batched_tokens=128, preemption_mode=mode,
              swap_space=0.05 if mode == "swap" else 0)
    llm = LLM(**kw, speculative_config={"model": random_draft, "num_speculative_tokens": 3})
    assert _tokens(run_checked(llm, prompts, per_prompt)) == want
    stats = llm.kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    if mode == "swap":
        assert stats.num_swapped_out > 0
    spec = llm.llm_engine.core.speculation.stats
    assert spec.num_draft_tokens > 0 and spec.acceptance_rate < 0.5
    assert stats.used_blocks == 0


def test_the_draft_takes_its_share_of_each_block(random_draft):
    """A fixed KV budget holds fewer blocks with a draft: each block also holds the draft's
    layers (2 layers x 2 KV heads x 16 head dim, against SmolLM2's 30 x 3 x 64)."""
    target = LLM(max_model_len=512, kv_cache_space=0.5).llm_engine.core
    both = LLM(max_model_len=512, kv_cache_space=0.5,
               speculative_config={"model": random_draft, "num_speculative_tokens": 2}).llm_engine.core
    target_bytes, draft_bytes = 2 * 30 * 16 * 3 * 64 * 4, 2 * 2 * 16 * 2 * 16 * 4
    assert target.bytes_per_block == target_bytes
    assert both.bytes_per_block == target_bytes + draft_bytes
    assert both.num_blocks == int(0.5 * (1 << 30)) // (target_bytes + draft_bytes) < target.num_blocks
    draft_cache = both.model_runner.drafter.cache_engine
    assert draft_cache.num_blocks == both.num_blocks and draft_cache.num_layers == 2


def test_draft_model_refusals(tmp_path, random_draft):
    small_vocab = tmp_path / "small-vocab"
    save_checkpoint(make_hf_model(tiny_config("llama")), small_vocab)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 49152"):
        LLM(max_model_len=512, num_kv_blocks=64,
            speculative_config={"model": str(small_vocab), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not built"):
        LLM(max_model_len=512, num_kv_blocks=64, tensor_parallel_size=3,
            speculative_config={"model": random_draft, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_model_len=4096 is larger than the draft model's"):
        LLM(max_model_len=512, num_kv_blocks=64,
            speculative_config={"model": random_draft, "num_speculative_tokens": 2, "max_model_len": 4096})
    with pytest.raises(ValueError, match="no-such-draft"):
        LLM(max_model_len=512, num_kv_blocks=64,
            speculative_config={"model": str(tmp_path / "no-such-draft"), "num_speculative_tokens": 2})


def test_a_sliding_window_target_refuses_a_draft(tmp_path, smollm2_gguf):
    from tests.integration.test_tiny_models import _tokenizer

    target = tmp_path / "sliding"
    save_checkpoint(make_hf_model(tiny_config("mistral", vocab_size=SMOLLM2_VOCAB, sliding_window=16)), target)
    _tokenizer(smollm2_gguf).save_pretrained(target)
    draft = tmp_path / "draft"
    save_checkpoint(make_hf_model(tiny_config("llama", vocab_size=SMOLLM2_VOCAB)), draft)
    with pytest.raises(ValueError, match="sliding-window KV cache groups"):
        LLM(str(target), num_kv_blocks=64, speculative_config={"model": str(draft), "num_speculative_tokens": 2})
