"""The fused C layer ops (kernels/fused_ops.c) against the torch expressions they replace, and
those torch paths themselves (taken on other dtypes, devices, under torch.compile)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import fused
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary_emb, compute_inv_freq, rotate_qkv

needs_kernel = pytest.mark.skipif(fused._kernel() is None, reason="no C compiler: torch only")


@pytest.fixture(params=["c", "torch"])
def path(request, monkeypatch):
    if request.param == "c":
        if fused._kernel() is None:
            pytest.skip("no C compiler")
    else:
        monkeypatch.setattr(fused, "_kernel", lambda: None)
    return request.param


def _hf_rms_norm(x, weight, eps):
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(path, rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x, residual = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    torch.testing.assert_close(norm(x), _hf_rms_norm(x, norm.weight, 1e-5), rtol=1e-5, atol=1e-5)
    out, new_residual = norm(x, residual.clone())
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(out, _hf_rms_norm(x + residual, norm.weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_silu_and_mul(path, rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :1536]) * x[:, 1536:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9, 200])
def test_rotate_qkv_matches_hf_rotary(path, tokens):
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=576, num_attention_heads=9, rope_theta=100000.0, max_position_embeddings=2048)
    rope = RotaryEmbedding(*compute_inv_freq(config))
    cos, sin = rope(torch.arange(tokens) * 7)
    qkv = torch.randn(tokens, (9 + 3 + 3) * 64, generator=torch.Generator().manual_seed(tokens))
    q0, k0, v0 = qkv.split([576, 192, 192], dim=-1)
    want_q, want_k = apply_rotary_emb(q0.reshape(tokens, 9, 64), k0.reshape(tokens, 3, 64), cos, sin)
    q, k, v = rotate_qkv(qkv.clone(), cos, sin, 9, 3, 64)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v0.reshape(tokens, 3, 64))


@needs_kernel
def test_kernel_declines_other_dtypes_and_layouts():
    x = torch.randn(4, 64)
    assert fused.fused_kernel_for(x) is not None
    assert fused.fused_kernel_for(x.bfloat16()) is None
    assert fused.fused_kernel_for(x.t()) is None  # not contiguous
    norm = RMSNorm(64).to(torch.bfloat16)
    torch.testing.assert_close(norm(x.bfloat16()), _hf_rms_norm(x.bfloat16(), norm.weight, 1e-6))


@needs_kernel
@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 49152), (3, 17), (300, 1000)])
def test_argmax_rows_equals_torch_first_maximum(rows, vocab):
    from pagedllm.layers.sampling_draw import argmax_rows

    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randint(-5, 5, (rows, vocab), generator=g).float()  # many equal maxima: the first wins
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(rows, vocab + 7, generator=g)
    view = wide[:, 3:3 + vocab]  # rows apart (a slice of a wider tensor)
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


@needs_kernel
def test_argmax_rows_nan_and_infinities_as_torch_max():
    from pagedllm.layers.sampling_draw import argmax_rows

    x = torch.tensor([[1.0, float("nan"), 5.0, float("nan")],
                      [float("-inf")] * 4,
                      [float("-inf"), 2.0, float("inf"), float("inf")],
                      [-1e30, -3e38, -1e30, -2.0]])
    assert argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist() == [1, 0, 2, 3]


@needs_kernel
@pytest.mark.parametrize("vocab", [16, 40, 1000])
@pytest.mark.parametrize("where", ["first", "middle", "tail"])
def test_argmax_rows_nan_anywhere_in_a_long_row(vocab, where):
    from pagedllm.layers.sampling_draw import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(2, vocab, generator=g)
    x[0, 5] = float("inf")
    at = {"first": 0, "middle": vocab // 2, "tail": vocab - 1}[where]
    x[1, at] = float("nan")
    x[1, -1 if at != vocab - 1 else 0] = float("nan")  # a second NaN: the first one wins
    assert argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist()
