"""Gemma 2 and Gemma 3 (text): tiny random checkpoints by transformers' own classes, greedy
through the whole engine equal to transformers' `generate` in every engine mode, logits parity,
and the Gemma parts shown to matter: transformers' own output changes without the attention /
final soft caps or with another window (so the parity is not vacuous), ours changes without the
q/k norms or with one rope table; our per-layer windows, rope tables, scales and caps equal
transformers'. Both windows (8) are shorter than every prompt but the first; the caps are small
enough that they bend these models' scores.

transformers' outputs are stored references (tests/references.py, arch_parity): the one-shot
prefill mode computes them live every run, the Gemma 2 and the Gemma 3 families' checks that
the store has not drifted from transformers."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig

from pagedllm.layers.backends import triton_attention_kernels
from pagedllm.model import get_model_class, load_model
from pagedllm.model.gemma2 import Gemma2ForCausalLM
from pagedllm.model.gemma3 import Gemma3ForCausalLM
from pagedllm.model.llama import LlamaAttention
from tests.integration.arch_parity import (
    MODES,
    build_tiny,
    check_engine_greedy,
    check_prefix_hits_greedy,
    greedy_reference,
    hf_greedy,
    our_prefill_logits,
    prefill_logits_max_abs,
    reference_prefix,
    tiny_prompts,
)
from tests.integration.model_fixtures import logits_reference
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

CONFIGS = {
    # Layers sliding / full / sliding / full; query_pre_attn_scalar 24 != head_dim 16.
    "gemma2": dict(kind="gemma2", sliding_window=8, attn_logit_softcapping=3.0, final_logit_softcapping=0.5),
    # Layers sliding, sliding, full, sliding (pattern 3); local rope base 100 against 1M with a
    # linear x2 scaling on the global layers; q/k norms.
    "gemma3": dict(kind="gemma3", sliding_window=8, sliding_window_pattern=3, rope_local_base_freq=100.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}, final_logit_softcapping=0.5),
}
_CLASSES = {"gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}


def _config(kind: str, **overrides):
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=256)
    return _CLASSES[kind](**(base | overrides))


# Random embeddings times sqrt(hidden) = 8 outweigh the post-normed layer outputs in the residual
# stream, and a tied head then repeats the last token: shrunk, the outputs are varied.
EMBED_SHRINK = 0.1


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    """`(name, path, transformers model, reference prefix)` of each tiny checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(_config(**CONFIGS[request.param]), path, seed=len(request.param))
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(EMBED_SHRINK)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, path, hf, reference_prefix(request, request.param)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny, mode):
    name, path, hf, refs = tiny
    check_engine_greedy(name, path, hf, mode, refs, live=mode == "whole-prefill")  # the families' live checks


def test_tensor_parallel_matches_transformers(tiny):
    """Two ranks (gloo): each its query / KV heads and intermediate slice, norms replicated."""
    name, path, hf, refs = tiny
    check_engine_greedy(f"{name} tp=2", path, hf, "preempt-recompute", refs, tensor_parallel_size=2)


def test_one_table_for_every_layer_still_matches_transformers(tiny):
    """--disable-hybrid-kv-cache-manager: the layout before KV cache groups."""
    name, path, hf, refs = tiny
    check_engine_greedy(f"{name} one table", path, hf, "chunked-prefill", refs,
                        disable_hybrid_kv_cache_manager=True)


def test_prefix_cache_hits_on_a_hybrid_cache_match_transformers(tiny):
    name, path, hf, refs = tiny
    check_prefix_hits_greedy(name, path, hf, refs)


@torch.no_grad()
def _hf_logits(hf, sequences):
    return [hf(torch.tensor([s])).logits[0] for s in sequences]


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_logits_match_and_layers_are_transformers(tiny):
    """Logits parity; our model's per-layer windows, scales, caps and rope tables are
    transformers' (read off its modules)."""
    name, path, hf, refs = tiny
    prefill_logits_max_abs(name, path, hf, tiny_prompts(1000), refs)
    model = load_model(str(path), None, hf.config, torch.float32, "cpu")
    cls = Gemma2ForCausalLM if name == "gemma2" else Gemma3ForCausalLM
    assert type(model) is cls is get_model_class(hf.config)
    assert model.embed_scale == 8.0 and model.final_logit_softcapping == hf.config.final_logit_softcapping
    windows = []
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        attn = ours.self_attn.attn
        assert attn.sliding_window == theirs.self_attn.sliding_window
        assert attn.scale == theirs.self_attn.scaling == 24**-0.5
        cap = theirs.self_attn.attn_logit_softcapping if name == "gemma2" else None  # Gemma 3 passes none
        assert attn.logits_soft_cap == cap
        windows.append(attn.sliding_window)
    assert windows == ([8, None, 8, None] if name == "gemma2" else [8, 8, None, 8])
    rotary = hf.model.rotary_emb
    if name == "gemma2":
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, rotary.inv_freq, rtol=0, atol=0)
    else:
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, rotary.full_attention_inv_freq, rtol=0, atol=0)
        torch.testing.assert_close(model.model.rotary_emb_local.inv_freq, rotary.sliding_attention_inv_freq,
                                   rtol=0, atol=0)
        assert not torch.equal(rotary.full_attention_inv_freq, rotary.sliding_attention_inv_freq)
        for ours, theirs in zip(model.model.layers, hf.model.layers):
            torch.testing.assert_close(ours.self_attn.k_norm.weight, theirs.self_attn.k_norm.weight, rtol=0, atol=0)


def test_soft_caps_and_windows_change_transformers_output(tiny, monkeypatch):
    """The parity is not vacuous: transformers itself gives other logits for these prompts
    without the attention soft cap (Gemma 2), without the final soft cap, or with the sliding
    window widened past every sequence, and other greedy tokens without the attention cap or
    the window (the final cap is monotonic: it changes logprobs and sampling, not argmaxes).
    transformers' side is stored (`<ref>.variants`): each changed model's largest logit change
    and its greedy tokens, and the change once undone."""
    name, path, hf, refs = tiny
    prompts = tiny_prompts(1000)
    greedy = greedy_reference(f"{refs}.greedy", path, hf, prompts)
    sequences = [p + g for p, g in zip(prompts, greedy)]
    variants = {"final_logit_softcapping": lambda: monkeypatch.setattr(hf.config, "final_logit_softcapping", None),
                "sliding_window": lambda: monkeypatch.setattr(hf.config, "sliding_window", 10**6)}
    if name == "gemma2":
        variants["attn_logit_softcapping"] = lambda: [monkeypatch.setattr(layer.self_attn, "attn_logit_softcapping",
                                                                          None) for layer in hf.model.layers]

    def compute():
        ref = _hf_logits(hf, sequences)
        out = {}
        for what, change in variants.items():
            change()
            out[what] = {"max_diff": _max_diff(_hf_logits(hf, sequences), ref),
                         "greedy": [hf_greedy(hf, p) for p in prompts]}
            monkeypatch.undo()
        out["undone_max_diff"] = _max_diff(_hf_logits(hf, sequences), ref)
        return out

    changed = reference(f"{refs}.variants", compute, sources=[path], inputs={
        "sequences": sequences, "prompts": prompts, "max_tokens": len(greedy[0]),
        "variants": {"final_logit_softcapping": None, "sliding_window": 10**6}
        | ({"attn_logit_softcapping (every layer)": None} if name == "gemma2" else {})})
    for what in variants:
        assert changed[what]["max_diff"] > 1e-2, what
        if what != "final_logit_softcapping":  # tanh is monotonic: the final cap never moves an argmax
            assert changed[what]["greedy"] != greedy, what
    assert changed["undone_max_diff"] == 0.0  # undone


def _ours_with(path, config, sequences, edit, monkeypatch):
    """Our prefill logits (arch_parity's runner) of the model as loaded, then `edit`ed."""
    import pagedllm.model as model_pkg

    load = model_pkg.load_model

    def load_and_edit(*args, **kwargs):
        model = load(*args, **kwargs)
        edit(model)
        return model

    with monkeypatch.context() as m:
        m.setattr(model_pkg, "load_model", load_and_edit)
        return our_prefill_logits(path, config, sequences)


def _each_attention(fn):
    return lambda model: [fn(layer.self_attn) for layer in model.model.layers]


def test_our_gemma_parts_matter(tiny, monkeypatch):
    """Our logits leave transformers' without each part: no window on any layer, no attention
    soft cap (Gemma 2); the global rope table on every layer, no q/k norms (Gemma 3)."""
    name, path, hf, refs = tiny
    sequences = [tiny_prompts(1000)[3]]
    ref = logits_reference(f"{refs}.logits", path, hf, tiny_prompts(1000))[3:]  # test_logits_match's
    edits = {"no window": _each_attention(lambda a: setattr(a.attn, "sliding_window", None))}
    if name == "gemma2":
        edits["no attention cap"] = _each_attention(lambda a: setattr(a.attn, "logits_soft_cap", None))
    else:
        edits["one rope table"] = lambda model: setattr(
            model.model, "rotary_tables", lambda positions, md: [model.model.rotary_emb(positions, md)] * 4)
        edits["no q/k norms"] = _each_attention(lambda a: setattr(a, "forward", types.MethodType(LlamaAttention.forward, a)))
    assert _max_diff(_ours_with(path, hf.config, sequences, lambda model: None, monkeypatch), ref) < 1e-4
    for what, edit in edits.items():
        assert _max_diff(_ours_with(path, hf.config, sequences, edit, monkeypatch), ref) > 1e-2, what


def test_unsupported_variants_are_refused():
    config = _config("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        Gemma3ForCausalLM(config)
    config = _config("gemma2", attn_logit_softcapping=-1.0)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
        Gemma2ForCausalLM(config)


@pytest.mark.skipif(not triton_attention_kernels.HAS_TRITON, reason="triton is not installed")
def test_triton_backend_matches_transformers(tiny, monkeypatch):
    """The Triton backend (its SOFTCAP kernels; Triton's interpreter on CPU) through the engine,
    chunked prefill then decode: transformers' tokens."""
    name, path, hf, refs = tiny
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # 8 tokens, not 32: the interpreter runs each program of each launch in Python (50 s a
    # family at 32); chunked prefill and the first decodes cross the same kernels and windows.
    check_engine_greedy(f"{name} triton", path, hf, "chunked-prefill", refs, max_tokens=8, attention_backend="triton")


# ---- GGUF: llama.cpp's gemma2 / gemma3 files ------------------------------------------------------

_GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "Q4_0", "ffn_gate": "Q5_0",
               "ffn_up": "BF16", "ffn_down": "Q8_0", "token_embd": "Q8_0"}


def _write_gemma_gguf(hf, arch: str, path, metadata: dict[str, float]) -> None:
    """`hf` as llama.cpp writes a Gemma (norms as 1 + w, its tensor names, no output.weight:
    tied), in mixed quantization types, with `metadata` ({arch}.key -> float); `hf`'s weights are
    rounded to what the file holds, so both sides compute with the same numbers."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_float32(f"{arch}.{key}", value)
    with torch.no_grad():
        for hf_name, param in hf.state_dict().items():
            if hf_name == "lm_head.weight":
                continue
            if hf_name in ("model.embed_tokens.weight", "model.norm.weight"):
                name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]
            else:
                _, _, layer, rest = hf_name.split(".", 3)
                module, _, suffix = rest.rpartition(".")
                name = f"blk.{layer}.{_GGUF_BLOCK[module]}.{suffix}"
            kind = name.split(".")[-2]
            w = param.numpy().astype(np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
            qtype = gguf.GGMLQuantizationType[_GGUF_TYPES.get(kind, "F32") if w.ndim == 2 else "F32"]
            data = w if qtype == gguf.GGMLQuantizationType.F32 else (
                w.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else quantize(w, qtype))
            writer.add_tensor(name, data, raw_dtype=qtype)
            stored = dequantize(data, qtype).reshape(w.shape) - (1.0 if name.endswith("norm.weight") else 0.0)
            param.copy_(torch.from_numpy(np.ascontiguousarray(stored)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_metadata(name: str, hf) -> dict[str, float]:
    caps = {"final_logit_softcapping": hf.config.final_logit_softcapping}
    return caps | ({"attn_logit_softcapping": hf.config.attn_logit_softcapping} if name == "gemma2" else {})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_file_matches_transformers(name, tmp_path):
    """A tiny llama.cpp-layout Gemma GGUF (Q8_0 / Q4_x matrices kept packed, norms stored as
    1 + w) loads to transformers' logits (of the same rounded weights). query_pre_attn_scalar is
    head_dim, as llama.cpp computes the scale of every Gemma but the 27B ones."""
    hf = build_tiny(_config(**CONFIGS[name], query_pre_attn_scalar=16), tmp_path, seed=len(name))  # llama.cpp's scale
    arch = "gemma2" if name == "gemma2" else "gemma3"
    _write_gemma_gguf(hf, arch, tmp_path / "tiny.gguf", _gguf_metadata(name, hf))
    model = load_model(str(tmp_path), "tiny.gguf", hf.config, torch.float32, "cpu")
    norm = model.model.layers[1].pre_feedforward_layernorm.weight
    torch.testing.assert_close(norm, hf.model.layers[1].pre_feedforward_layernorm.weight, rtol=0, atol=1e-6)
    sequences = tiny_prompts(1000)[2:]
    ours = our_prefill_logits(tmp_path / "tiny.gguf", hf.config, sequences)
    # transformers' model of the file's rounded weights: keyed by the folder (config, file)
    theirs = logits_reference(f"arch_gemma.gguf-{name}.logits", tmp_path, hf, sequences,
                              inputs={"weights": "tiny.gguf, dequantized"})
    assert _max_diff(ours, theirs) < 1e-4


def test_gguf_metadata_that_the_config_lost_is_refused(tmp_path):
    """transformers' GGUF config reader keeps the default caps, no Gemma 3 rope scaling and
    query_pre_attn_scalar 256: a file whose metadata says otherwise is refused by name."""
    hf = build_tiny(_config(**CONFIGS["gemma2"], query_pre_attn_scalar=16), tmp_path, seed=6)
    _write_gemma_gguf(hf, "gemma2", tmp_path / "caps.gguf", {"attn_logit_softcapping": 50.0,
                                                             "final_logit_softcapping": 0.5})
    with pytest.raises(ValueError, match=r"attn_logit_softcapping: file 50, config 3.0"):
        load_model(str(tmp_path), "caps.gguf", hf.config, torch.float32, "cpu")
    hf = build_tiny(_config(**CONFIGS["gemma3"], query_pre_attn_scalar=16), tmp_path / "g3", seed=6)
    _write_gemma_gguf(hf, "gemma3", tmp_path / "rope.gguf", {"final_logit_softcapping": 0.5,
                                                             "rope.scaling.factor": 8.0})
    with pytest.raises(ValueError, match=r"rope scaling factor: file 8, config 2.0"):
        load_model(str(tmp_path), "rope.gguf", hf.config, torch.float32, "cpu")
    big = _config(**(CONFIGS["gemma3"] | dict(num_hidden_layers=62)))  # llama.cpp's 27B: hidden / heads = 16
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar \(llama.cpp: hidden / heads for 27B, else head_dim\): file 16, config 24"):
        load_model(str(tmp_path), "rope.gguf", big, torch.float32, "cpu")


# ---- the layers, against transformers' own modules ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_and_activation_are_transformers(dtype):
    """GemmaRMSNorm is transformers' Gemma2RMSNorm / Gemma3RMSNorm bit for bit (torch path; the
    fused C kernel in float32 to rounding), with and without the fused residual add; in bfloat16
    Llama's order (downcast, then multiply) gives other values. GeluTanhAndMul is
    `gelu_pytorch_tanh(gate) * up`."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from pagedllm.layers.activation import GeluTanhAndMul
    from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    residual = torch.randn(7, 64, generator=g).to(dtype)
    w = (torch.randn(64, generator=g) * 0.5).to(dtype)
    ours = GemmaRMSNorm(64, 1e-6, dtype=dtype)
    ours.weight.data.copy_(w)
    for cls in (Gemma2RMSNorm, Gemma3RMSNorm):
        theirs = cls(64, eps=1e-6).to(dtype)
        theirs.weight.data.copy_(w)
        with torch.no_grad():
            want = theirs(x)
            want_sum = theirs(x + residual)
        exact = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)  # float32: C kernel
        torch.testing.assert_close(ours(x), want, **exact)
        out, summed = ours(x.clone(), residual.clone())
        torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
        torch.testing.assert_close(out, want_sum, **exact)
        torch.testing.assert_close(ours._norm(x), want, rtol=0, atol=0)  # the torch path: bit for bit
    if dtype == torch.bfloat16:
        llama_order = RMSNorm(64, 1e-6, dtype=dtype)
        llama_order.weight.data.copy_(1.0 + w.float())
        assert not torch.equal(llama_order(x), want)
    gate_up = torch.randn(5, 2 * 48, generator=g).to(dtype)
    want = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :48]) * gate_up[:, 48:]
    torch.testing.assert_close(GeluTanhAndMul()(gate_up), want, **exact)  # float32: the C kernel (fused_ops.c)
