"""Quantized checkpoint formats (quantization/): packing against formulas written here,
and each format's linear layer against a plain-torch dequantize-then-matmul reference.

The references below are deliberately written from the formats' descriptions, not from
pagedllm's packing helpers: word `w` of a sequentially packed tensor holds element `pf*w + i` at
bits `bits*i`; AutoAWQ's words hold column `8w + [0,2,4,6,1,3,5,7][i]` at nibble `i`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.quantization.config_detection import get_quantization_config
from pagedllm.quantization.formats.awq import AWQConfig
from pagedllm.quantization.formats.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.formats.gptq import GPTQConfig
from pagedllm.quantization.formats.packing import pack_awq, pack_int32, unpack_awq, unpack_int32

AWQ_NIBBLE_TO_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]
REL = 1e-5


def ref_pack(codes: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Formula: word w = sum_i code[pf*w + order[i]] << (bits*i), as int32 bits."""
    pf = 32 // bits
    order = order or list(range(pf))
    c = codes.movedim(dim, -1).numpy().astype(np.uint64)
    words = np.zeros(c.shape[:-1] + (c.shape[-1] // pf,), dtype=np.uint64)
    for w in range(words.shape[-1]):
        for i in range(pf):
            words[..., w] |= c[..., pf * w + order[i]] << np.uint64(bits * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32)).movedim(-1, dim).contiguous()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_forward(layer, x: torch.Tensor, ref: torch.Tensor) -> None:
    """The layer's exact path equals the reference to float32 rounding; its int8 path (where the
    C kernel holds the weights) within 1e-2 (the bound is argued in tests/unit/test_int_gemm.py)."""
    assert rel_err(layer(x), ref) <= REL
    if getattr(layer, "int_weight", None) is not None:
        method = layer.quant_method
        method.compute = "int8"
        try:
            assert rel_err(layer(x), ref) <= 1e-2
        finally:
            method.compute = "exact"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_sequential_packing_matches_formula(bits, dim):
    g = torch.Generator().manual_seed(bits + dim)
    codes = torch.randint(0, 1 << bits, (16, 24), generator=g, dtype=torch.int32)
    packed = pack_int32(codes, bits, dim)
    assert packed.dtype == torch.int32
    assert torch.equal(packed, ref_pack(codes, bits, dim))
    assert torch.equal(unpack_int32(packed, bits, dim), codes)
    assert int(packed.min()) < 0  # the sign bit is used (top code >= 8) and survives


def test_awq_interleaved_order_matches_formula():
    codes = torch.randint(0, 16, (12, 32), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = pack_awq(codes)
    assert packed.shape == (12, 4)
    assert torch.equal(packed, ref_pack(codes, 4, 1, AWQ_NIBBLE_TO_COLUMN))
    assert torch.equal(unpack_awq(packed), codes)
    # one word by hand: columns 0..7 = 1..8 -> nibbles hold 1,3,5,7,2,4,6,8
    word = pack_awq(torch.arange(1, 9, dtype=torch.int32).view(1, 8) % 16)
    assert int(word) & 0xFFFFFFFF == sum(v << (4 * i) for i, v in enumerate([1, 3, 5, 7, 2, 4, 6, 8]))


# ---- layers from hand-packed checkpoint tensors ----------------------------------------------

def _case(out, k, bits, gs, seed, asym=True):
    g = torch.Generator().manual_seed(seed)
    groups = k // gs
    codes = torch.randint(0, 1 << bits, (out, k), generator=g, dtype=torch.int32)  # [out, in]
    zeros = (torch.randint(1 if asym else 0, 1 << bits, (out, groups), generator=g, dtype=torch.int32)
             if asym else torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32))
    scales = (torch.rand(out, groups, generator=g) * 0.02 + 0.001).half()
    return codes, zeros, scales


def ref_weight(codes, zeros, scales, g_idx):
    """W[o, r] = (code[o, r] - zero[o, g_idx[r]]) * scale[o, g_idx[r]] in float32."""
    return (codes - zeros[:, g_idx]).float() * scales[:, g_idx].float()


def _build(method, in_f, outs):
    layer = (MergedLinear(in_f, outs, quant_method=method) if len(outs) > 1
             else Linear(in_f, outs[0], quant_method=method))
    return layer


def _load(layer, tensors_per_shard):
    for shard, tensors in enumerate(tensors_per_shard):
        for name, t in tensors.items():
            if isinstance(layer, MergedLinear):
                layer.load_shard(shard, name, t)
            else:
                layer.load_weight(name, t)
    layer.process_weights_after_loading()


def _gptq_tensors(codes, zeros, scales, bits, g_idx, v2):
    stored = zeros if v2 else zeros - 1  # v1: stored zero = zero - 1
    return {"qweight": ref_pack(codes.t(), bits, 0), "qzeros": ref_pack(stored.t(), bits, 1),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


@pytest.mark.parametrize("bits,v2,act_order,gs", [(4, False, False, 16), (4, True, True, 16), (8, False, True, 32),
                                                  (8, True, False, -1)])
def test_gptq_layer_vs_reference(bits, v2, act_order, gs):
    k, outs = 64, [32, 16, 16]
    group = k if gs == -1 else gs
    cfg = GPTQConfig.from_config({"bits": bits, "group_size": gs, "desc_act": act_order, "sym": False,
                                  "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    layer = _build(cfg.get_linear_method("p.qkv_proj", ["p.q_proj", "p.k_proj", "p.v_proj"]), k, outs)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(7))]
    shards, refs = [], []
    for s, n in enumerate(outs):
        codes, zeros, scales = _case(n, k, bits, group, seed=10 * s + bits)
        shards.append(_gptq_tensors(codes, zeros, scales, bits, g_idx, v2))
        refs.append(ref_weight(codes, zeros, scales, g_idx))
    _load(layer, shards)
    assert (layer.perm is not None) == act_order
    assert {n for n, _ in layer.named_parameters()} == set()  # packed buffers only, no float weight
    if layer.int_weight is not None:  # the C kernel's packed form is all it keeps
        assert not hasattr(layer, "qweight") and layer.int_weight.bits == bits
        assert layer.int_weight.data.numel() < k * sum(outs) * bits / 8 * 1.4
    else:
        assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (k * bits // 32, sum(outs))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    ref = x @ torch.cat(refs).t()
    check_forward(layer, x, ref)


def test_awq_layer_vs_reference():
    k, outs, gs = 64, [48, 48], 32
    cfg = AWQConfig.from_config({"w_bit": 4, "q_group_size": gs, "zero_point": True, "version": "GEMM"})
    layer = _build(cfg.get_linear_method("p.gate_up_proj", ["p.gate_proj", "p.up_proj"]), k, outs)
    shards, refs = [], []
    g_idx = torch.arange(k) // gs
    for s, n in enumerate(outs):
        codes, zeros, scales = _case(n, k, 4, gs, seed=s)
        shards.append({"qweight": ref_pack(codes.t(), 4, 1, AWQ_NIBBLE_TO_COLUMN),
                       "qzeros": ref_pack(zeros.t(), 4, 1, AWQ_NIBBLE_TO_COLUMN), "scales": scales.t().contiguous()})
        refs.append(ref_weight(codes, zeros, scales, g_idx))
    _load(layer, shards)
    x = torch.randn(3, k)
    check_forward(layer, x, x @ torch.cat(refs).t())


def test_awq_modules_to_not_convert():
    cfg = AWQConfig.from_config({"bits": 4, "group_size": 32, "modules_to_not_convert": ["mlp"]})
    assert cfg.get_linear_method("m.mlp.down_proj", ["m.mlp.down_proj"]) is None
    assert cfg.get_linear_method("m.self_attn.o_proj", ["m.self_attn.o_proj"]) is not None


def _ct_config(bits, sym, strategy, gs=None, ignore=("lm_head",), targets=("Linear",)):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": list(targets), "weights": {
                "num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy, "group_size": gs,
                "dynamic": False, "actorder": None}}}, "ignore": list(ignore)}


@pytest.mark.parametrize("bits,sym,gs,int8_zp", [(4, True, 16, False), (8, False, -1, False), (4, False, 32, True)])
def test_compressed_tensors_layer_vs_reference(bits, sym, gs, int8_zp):
    k, outs = 64, [32, 16, 16]
    group = k if gs == -1 else gs
    cfg = CompressedTensorsConfig.from_config(_ct_config(bits, sym, "channel" if gs == -1 else "group",
                                                          None if gs == -1 else gs))
    layer = _build(cfg.get_linear_method("p.qkv_proj", ["p.q_proj", "p.k_proj", "p.v_proj"]), k, outs)
    offset = 1 << (bits - 1)
    shards, refs = [], []
    for s, n in enumerate(outs):
        codes, zeros, scales = _case(n, k, bits, group, seed=s + 3, asym=not sym)  # unsigned domain
        # on disk: signed q = code - offset stored as q + offset, i.e. the unsigned code
        t = {"weight_packed": ref_pack(codes, bits, 1), "weight_scale": scales,
             "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
        if not sym:
            t["weight_zero_point"] = ((zeros - offset).to(torch.int8) if int8_zp
                                      else ref_pack(zeros, bits, 0))
        shards.append(t)
        signed_q, signed_zp = codes - offset, zeros - offset  # W = (q - zp) * scale
        refs.append(ref_weight(signed_q, signed_zp, scales, torch.arange(k) // group))
    _load(layer, shards)
    x = torch.randn(4, k)
    check_forward(layer, x, x @ torch.cat(refs).t())


def test_compressed_tensors_targets_and_ignore():
    cfg = CompressedTensorsConfig.from_config(_ct_config(4, True, "group", 32, ignore=["re:.*down_proj$"],
                                                         targets=["re:.*mlp\\..*"]))
    assert cfg.get_linear_method("l.mlp.down_proj", ["l.mlp.down_proj"]) is None  # ignored
    assert cfg.get_linear_method("l.mlp.gate_up_proj", ["l.mlp.gate_proj", "l.mlp.up_proj"]) is not None
    assert cfg.get_linear_method("l.self_attn.o_proj", ["l.self_attn.o_proj"]) is None  # not targeted
    with pytest.raises(ValueError, match="W8A8"):
        CompressedTensorsConfig.from_config(_ct_config(8, True, "channel") | {
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                    "strategy": "channel"}, "input_activations": {"num_bits": 8}}}})


# ---- errors ------------------------------------------------------------------------------------

def _gptq_layer(bits=4, gs=16):
    cfg = GPTQConfig.from_config({"bits": bits, "group_size": gs, "sym": True})
    return _build(cfg.get_linear_method("m.o_proj", ["m.o_proj"]), 64, [32])


def test_bad_tensors_are_named_errors():
    layer = _gptq_layer()
    with pytest.raises(ValueError, match=r"m\.o_proj.*qweight has shape \(4, 32\), expected \(8, 32\)"):
        layer.load_weight("qweight", torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"qweight has dtype torch.float32"):
        layer.load_weight("qweight", torch.zeros(8, 32))
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensor 'weight_scale'"):
        layer.load_weight("weight_scale", torch.zeros(4, 32))
    with pytest.raises(ValueError, match="bits=3"):
        GPTQConfig.from_config({"bits": 3, "group_size": 16})
    with pytest.raises(ValueError, match="bits=8"):
        AWQConfig.from_config({"bits": 8, "group_size": 16})
    with pytest.raises(ValueError, match="group_size 24 does not divide the input size 64"):
        _gptq_layer(gs=24)
    merged = _build(GPTQConfig.from_config({"bits": 4, "group_size": 16, "desc_act": True}).get_linear_method(
        "m.gate_up_proj", ["m.gate_proj", "m.up_proj"]), 64, [32, 32])
    merged.load_shard(0, "g_idx", torch.arange(64, dtype=torch.int32) // 16)
    with pytest.raises(ValueError, match="g_idx .shard 1. differs between the shards"):
        merged.load_shard(1, "g_idx", torch.arange(63, -1, -1, dtype=torch.int32) // 16)


class _Cfg:
    def __init__(self, qc=None):
        if qc is not None:
            self.quantization_config = qc


def test_detection_and_forced_method():
    assert get_quantization_config(_Cfg(), None) is None
    assert isinstance(get_quantization_config(_Cfg({"quant_method": "gptq", "bits": 4, "group_size": 32}), None),
                      GPTQConfig)
    assert isinstance(get_quantization_config(_Cfg(_ct_config(4, True, "group", 32)), "compressed-tensors"),
                      CompressedTensorsConfig)
    with pytest.raises(ValueError, match="quantization='awq' was given, but .* says quant_method 'gptq'"):
        get_quantization_config(_Cfg({"quant_method": "gptq", "bits": 4}), "awq")
    with pytest.raises(ValueError, match="has no quantization_config"):
        get_quantization_config(_Cfg(), "gptq")
    with pytest.raises(ValueError, match="not a GGUF file"):
        get_quantization_config(_Cfg(), "gguf")
    with pytest.raises(ValueError, match="model is a GGUF file"):
        get_quantization_config(_Cfg(), "gptq", is_gguf=True)
    with pytest.raises(ValueError, match=r"'bitsandbytes'.*not supported"):
        get_quantization_config(_Cfg({"quant_method": "bitsandbytes"}), None)


def test_bfloat16_activations_and_bias():
    """A bfloat16 model: the float32 dequantized weight is cast once per call; bias added."""
    k, n, gs = 64, 32, 16
    cfg = GPTQConfig.from_config({"bits": 4, "group_size": gs, "sym": True, "checkpoint_format": "gptq_v2"})
    layer = Linear(k, n, bias=True, dtype=torch.bfloat16, quant_method=cfg.get_linear_method("m.o", ["m.o"]))
    codes, zeros, scales = _case(n, k, 4, gs, seed=5, asym=False)
    g_idx = torch.arange(k) // gs
    _load(layer, [_gptq_tensors(codes, zeros, scales, 4, g_idx, v2=True)
                  | {"bias": torch.randn(n, dtype=torch.bfloat16)}])
    x = torch.randn(3, k, dtype=torch.bfloat16)
    ref = x @ ref_weight(codes, zeros, scales, g_idx).t().to(torch.bfloat16) + layer.bias
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_portable_path_without_the_kernel(monkeypatch):
    """Where int_gemm.c does not take the layer (no compiler, GPU, odd group sizes) the layer
    keeps the canonical tensors and dequantizes per call: same values."""
    import pagedllm.quantization.formats.base as base

    monkeypatch.setattr(base, "kernel_supports", lambda *a: False)
    k, n, gs = 64, 32, 32
    cfg = GPTQConfig.from_config({"bits": 4, "group_size": gs, "sym": False})
    layer = _build(cfg.get_linear_method("m.o", ["m.o"]), k, [n])
    codes, zeros, scales = _case(n, k, 4, gs, seed=3)
    g_idx = torch.arange(k) // gs
    _load(layer, [_gptq_tensors(codes, zeros, scales, 4, g_idx, v2=False)])
    assert layer.int_weight is None and layer.qweight.dtype == torch.int32
    x = torch.randn(4, k)
    assert rel_err(layer(x), x @ ref_weight(codes, zeros, scales, g_idx).t()) <= REL
