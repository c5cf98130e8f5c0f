"""Phi-3 / Phi-4-mini: tiny random checkpoints by transformers' own class (fused qkv_proj and
gate_up_proj in the checkpoint), greedy through the whole engine equal to transformers'
`generate` in every engine mode, logits parity; LongRoPE with prompts on both sides of
`original_max_position_embeddings` and sequences that grow across it (recomputed once, as
transformers drops its cache there), partial rotary, sliding window.

transformers' outputs are stored references (tests/references.py, arch_parity): the
LongRoPE checkpoint's one-shot prefill mode computes its greedy reference live every run, the
Phi-3 family's check that the store has not drifted from transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import Phi3Config

from pagedllm.model import get_model_class
from pagedllm.model.phi3 import Phi3ForCausalLM
from tests.integration.arch_parity import (
    MODES,
    build_tiny,
    check_engine_greedy,
    check_prefix_hits_greedy,
    greedy_reference,
    our_prefill_logits,
    prefill_logits_max_abs,
    reference_prefix,
    tiny_checkpoint_fixture,
    tiny_prompts,
)
from tests.integration.model_fixtures import float32_lists
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

ORIGINAL = 32  # the 5- and 19-token prompts cross it while generating; 37 and 53 start past it


def _longrope(rotary_dims: int) -> dict:
    half = rotary_dims // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [1.5 + 0.75 * i for i in range(half)]}


CONFIGS = {
    # Phi-4-mini's shape: LongRoPE over 0.75 of each head, tied head.
    "phi3-longrope-partial": dict(partial_rotary_factor=0.75, rope_parameters=_longrope(12),
                                  original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True),
    # Phi-3-mini-4k's: plain rope, a sliding window on every layer (shorter than the prompts).
    "phi3-sliding": dict(sliding_window=16, tie_word_embeddings=False),
}


def _config(**overrides) -> Phi3Config:
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return Phi3Config(**(base | overrides))


tiny = tiny_checkpoint_fixture(CONFIGS, _config)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny, mode):
    name, path, hf, refs = tiny
    check_engine_greedy(name, path, hf, mode, refs, live=name == "phi3-longrope-partial" and mode == "whole-prefill")


def test_prefix_cache_hits_match_transformers(tiny):
    name, path, hf, refs = tiny
    check_prefix_hits_greedy(name, path, hf, refs)


def test_checkpoint_is_fused_and_logits_match(tiny):
    name, path, hf, refs = tiny
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys and "model.layers.0.mlp.gate_up_proj.weight" in keys
    assert get_model_class(hf.config) is Phi3ForCausalLM
    prefill_logits_max_abs(name, path, hf, tiny_prompts(1000), refs)


def test_long_factors_apply_past_the_original_length(tmp_path):
    """The 53-token prompt (past 32) is computed with the long factors at every position: the
    first 20 positions' logits equal transformers' on the whole prompt, not on its first 20."""
    hf = build_tiny(_config(**CONFIGS["phi3-longrope-partial"]), tmp_path, seed=3)
    prompt = tiny_prompts(1000)[3]
    ours = our_prefill_logits(tmp_path, hf.config, [prompt])[0]

    @torch.no_grad()
    def compute():  # transformers' first 20 rows on the whole prompt; how far its first 20 alone are
        whole = hf(torch.tensor([prompt])).logits[0]
        head = hf(torch.tensor([prompt[:20]])).logits[0]
        return {"whole_head20": float32_lists(whole[:20]), "regimes_max_diff": float((whole[:20] - head).abs().max())}

    theirs = reference("arch_phi3.long-factors", compute, sources=[tmp_path], inputs={"prompt": prompt, "rows": 20})
    torch.testing.assert_close(ours[:20], torch.tensor(theirs["whole_head20"], dtype=torch.float32), atol=1e-4, rtol=0)
    assert theirs["regimes_max_diff"] > 1e-2  # the two regimes differ


def test_quantized_phi3_is_refused():
    from pagedllm.quantization.config_detection import get_quantization_config

    config = _config()
    config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    quant = get_quantization_config(config, None, is_gguf=False, compute="exact")
    with pytest.raises(ValueError, match="Quantized Phi-3 checkpoints"):
        Phi3ForCausalLM(config, quant_config=quant)


def _run(path, **kwargs):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(path), block_size=8, num_kv_blocks=256, **kwargs)
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts(1000)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
    recomputes = llm.llm_engine.scheduler.num_long_context_recomputes
    llm.shutdown()
    return outs, recomputes


def test_growing_past_the_original_length_recomputes_once(tmp_path, monkeypatch, request):
    """The 5- and 19-token prompts cross 32 tokens while generating: each is recomputed once in
    the long regime (twice over two rounds), prefix caching on (the second round hits blocks of
    the right regime only). Without the recompute the output leaves transformers'."""
    path = tmp_path
    name = "phi3-longrope-partial"
    hf = build_tiny(_config(**CONFIGS[name]), path, seed=len(name))  # the fixture's checkpoint
    theirs = greedy_reference(f"{reference_prefix(request, name)}.greedy", path, hf, tiny_prompts(1000))
    outs, recomputes = _run(path, enable_prefix_caching=True)
    assert outs == [theirs, theirs] and recomputes == 4

    import pagedllm.engine.core_startup as startup  # where the scheduler's config is made

    monkeypatch.setattr(startup, "long_context_threshold", lambda *a: None)
    outs, recomputes = _run(path, enable_prefix_caching=False)
    assert recomputes == 0 and outs[0][2:] == theirs[2:] and outs[0][:2] != theirs[:2]


def test_tensor_parallel_matches_transformers(tiny):
    """Two ranks (gloo): each its query / KV heads and intermediate slice (cut from the
    checkpoint's tensors by `checkpoint_slices`), greedy still transformers'."""
    name, path, hf, refs = tiny
    check_engine_greedy(f"{name} tp=2", path, hf, "preempt-recompute", refs, tensor_parallel_size=2)
