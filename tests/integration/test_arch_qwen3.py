"""Qwen3 (dense): tiny random checkpoints by transformers' own class, greedy through the whole
engine equal to transformers' `generate` in every engine mode, logits parity, and the q/k norms
shown to matter (skipping them changes the logits).

transformers' outputs are stored references (tests/references.py, arch_parity): the `qwen3`
checkpoint's one-shot prefill mode computes its greedy reference live every run, the Qwen3
family's check that the store has not drifted from transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from pagedllm.model import get_model_class, load_model
from pagedllm.model.llama import LlamaAttention
from pagedllm.model.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from tests.integration.arch_parity import (
    MODES,
    build_tiny,
    check_engine_greedy,
    check_prefix_hits_greedy,
    logits_reference,
    our_prefill_logits,
    prefill_logits_max_abs,
    tiny_checkpoint_fixture,
    tiny_prompts,
)

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

CONFIGS = {
    # head_dim 32 != hidden / heads (16), as in every released Qwen3; GQA 4/2; untied head.
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),
    # Tied head, sliding-window layers from layer 1 on (window 8 < every prompt but the first).
    "qwen3-tied-sliding": dict(head_dim=16, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                               max_window_layers=1),
}


def _config(**overrides) -> Qwen3Config:
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rope_theta=1_000_000.0)
    return Qwen3Config(**(base | overrides))


tiny = tiny_checkpoint_fixture(CONFIGS, _config)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny, mode):
    name, path, hf, refs = tiny
    check_engine_greedy(name, path, hf, mode, refs, live=name == "qwen3" and mode == "whole-prefill")


def test_prefix_cache_hits_match_transformers(tiny):
    name, path, hf, refs = tiny
    check_prefix_hits_greedy(name, path, hf, refs)


def test_logits_match_and_qk_norms_matter(tiny, monkeypatch):
    name, path, hf, refs = tiny
    sequences = tiny_prompts(1000)
    prefill_logits_max_abs(name, path, hf, sequences, refs)
    model = load_model(str(path), None, hf.config, torch.float32, "cpu")
    assert type(model) is Qwen3ForCausalLM is get_model_class(hf.config)
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, Qwen3Attention) for layer in layers)
    for ours, theirs in zip(layers, hf.model.layers):
        torch.testing.assert_close(ours.self_attn.q_norm.weight, theirs.self_attn.q_norm.weight, rtol=0, atol=0)
        assert ours.self_attn.attn.sliding_window == theirs.self_attn.sliding_window
    # The same checkpoint without the q/k norms (Llama's forward) gives other logits.
    ref = logits_reference(f"{refs}.logits", path, hf, sequences)[2]  # prefill_logits_max_abs's, stored
    monkeypatch.setattr(Qwen3Attention, "forward", LlamaAttention.forward)
    without = our_prefill_logits(path, hf.config, [sequences[2]])[0]
    assert float((without - ref).abs().max()) > 1e-2



def test_tensor_parallel_matches_transformers(tiny):
    """Two ranks (gloo): each its query / KV heads and intermediate slice (cut from the
    checkpoint's tensors by `checkpoint_slices`), greedy still transformers'."""
    name, path, hf, refs = tiny
    check_engine_greedy(f"{name} tp=2", path, hf, "preempt-recompute", refs, tensor_parallel_size=2)
