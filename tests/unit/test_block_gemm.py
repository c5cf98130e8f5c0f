"""Exact block encodings of float32 weights (pagedllm/quantization/formats/exact_block_encoding.py) and the GEMM that uses
them (kernels/int_gemm.c's exact path via `layers.linear.linear`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import linear as linear_mod
from pagedllm.quantization.formats.exact_block_encoding import FORMAT_Q4A, FORMAT_Q8S, find_block_encoding
from pagedllm.layers.linear import linear, prepare_weight
from pagedllm.quantization.kernels.int_kernel import unpack_int_weight
from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor

needs_kernel = pytest.mark.skipif(linear_mod._block_kernel() is None, reason="no C compiler: F.linear only")


def gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight as a GGUF file holds it: raw Q4_1 / Q8_0 blocks made by llama.cpp's rule
    (scale from the block's range, rounded to float16), dequantized by our GGUF loader."""
    from gguf import GGMLQuantizationType as T

    g = np.random.default_rng(seed)
    x = g.standard_normal((rows, cols // 32, 32)).astype(np.float32) * 0.05
    if kind == "q4_1":
        lo, hi = x.min(-1), x.max(-1)
        d = ((hi - lo) / 15).astype(np.float16)
        q = np.clip(np.round((x - lo[..., None]) / d.astype(np.float32)[..., None]), 0, 15).astype(np.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        raw = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), lo.astype(np.float16).view(np.uint8).reshape(rows, -1, 2),
                              packed], axis=-1)  # fmt: skip
        return dequantize_tensor(raw.reshape(rows, -1), T.Q4_1).reshape(rows, cols)
    d = (np.abs(x).max(-1) / 127).astype(np.float16)
    q = np.clip(np.round(x / d.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), q.view(np.uint8)], axis=-1)
    return dequantize_tensor(raw.reshape(rows, -1), T.Q8_0).reshape(rows, cols)


def decode(encoding, shape) -> torch.Tensor:
    codes = encoding.codes.reshape(shape[0], -1, 32)
    if encoding.format == FORMAT_Q8S:
        return (codes.view(torch.int8).float() * encoding.scales[..., None]).reshape(shape)
    return (codes.float() * encoding.scales[..., None] + encoding.offsets[..., None]).reshape(shape)


@pytest.mark.parametrize("kind,fmt", [("q4_1", FORMAT_Q4A), ("q8_0", FORMAT_Q8S)])
def test_gguf_weights_have_an_exact_encoding(kind, fmt):
    w = gguf_blocks(kind, 96, 128)
    encoding = find_block_encoding(w)
    assert encoding is not None and encoding.format == fmt
    assert torch.equal(decode(encoding, w.shape), w)  # bit for bit


def test_weights_off_the_grid_have_none():
    assert find_block_encoding(torch.randn(64, 64)) is None
    w = gguf_blocks("q4_1", 64, 64)
    w[3, 7] = torch.nextafter(w[3, 7], torch.tensor(1.0))  # one value one ulp off its grid
    assert find_block_encoding(w) is None
    assert find_block_encoding(torch.randn(8, 40)) is None  # rows not whole blocks


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 16, 17, 20, 150, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (40, 64)])
def test_block_kernel_matches_f_linear(kind, rows, out_features, in_features, monkeypatch):
    w = gguf_blocks(kind, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    real = linear_mod.packed_gemm_kernel()
    monkeypatch.setattr(linear_mod, "_kernel", lambda: real._replace(gemm=lambda *a: pytest.fail("packed gemm used")))
    prepared = prepare_weight(w)
    assert prepared.blocks is not None and prepared.blocks.bits == (4 if kind == "q4_1" else 8)
    assert torch.equal(unpack_int_weight(prepared.blocks), w)  # the packed form is the weight, bit for bit
    torch.testing.assert_close(linear(x, w, prepared=prepared), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_block_form_replaces_the_float32_panels_unless_disabled(monkeypatch):
    w = gguf_blocks("q4_1", 64, 64)
    x = torch.randn(20, 64)
    prepared = prepare_weight(w)
    assert prepared.blocks is not None and prepared.packed is None  # no float32 copy kept
    monkeypatch.setattr(linear_mod, "USE_BLOCK_WEIGHTS", False)  # PAGEDLLM_BLOCK_WEIGHTS=0
    monkeypatch.setattr(linear_mod, "_int_matmul", lambda *a: pytest.fail("block form used"))
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert prepare_weight(w).packed is not None
