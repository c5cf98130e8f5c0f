"""Llama-family models with sliding windows on the KV cache groups (issue 25): Mistral with one
window on every layer (one sliding group) and Qwen2 with sliding layers above
`max_window_layers` (a full group and a sliding one). Greedy through the whole engine equals
transformers' `generate` in every engine mode, with prefix-cache hits and with two
tensor-parallel ranks, and the windows do give blocks back (asserted by `check_engine_greedy`).
Both windows (12) are shorter than every prompt but the first.

transformers' outputs are stored references (tests/references.py, arch_parity): Qwen2's
(full and sliding groups) one-shot prefill mode computes its greedy reference live every run,
the sliding-window family's check that the store has not drifted from transformers."""

from __future__ import annotations

import pytest
from transformers import MistralConfig, Qwen2Config

from pagedllm.core.kv_cache_groups import hybrid_kv_cache_groups
from tests.integration.arch_parity import MODES, check_engine_greedy, check_prefix_hits_greedy, tiny_checkpoint_fixture

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

CONFIGS = {
    "mistral-window12": dict(kind="mistral", sliding_window=12),
    "qwen2-sliding-above-1": dict(kind="qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1,
                                  tie_word_embeddings=True),
}
_CLASSES = {"mistral": MistralConfig, "qwen2": Qwen2Config}


def _config(kind: str, **overrides):
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    return _CLASSES[kind](**(base | overrides))


tiny = tiny_checkpoint_fixture(CONFIGS, _config)


def test_groups_follow_the_config(tiny):
    name, _, hf, _ = tiny
    groups = hybrid_kv_cache_groups(hf.config)
    windows = [g.sliding_window for g in groups.groups]
    assert windows == ([12] if name.startswith("mistral") else [None, 12, 12])


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny, mode):
    name, path, hf, refs = tiny
    check_engine_greedy(name, path, hf, mode, refs, live=name == "qwen2-sliding-above-1" and mode == "whole-prefill")


def test_prefix_cache_hits_match_transformers(tiny):
    name, path, hf, refs = tiny
    check_prefix_hits_greedy(name, path, hf, refs)


def test_tensor_parallel_matches_transformers(tiny):
    name, path, hf, refs = tiny
    check_engine_greedy(f"{name} tp=2", path, hf, "preempt-recompute", refs, tensor_parallel_size=2)
