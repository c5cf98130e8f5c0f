"""The C packed-weight GEMM behind every projection (`layers.linear.linear`) against `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import linear as linear_mod
from pagedllm.layers.linear import linear

needs_kernel = pytest.mark.skipif(linear_mod._kernel() is None, reason="no C compiler: F.linear only")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 12, 13, 20, 33, 144, 145, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (8, 64), (37, 5), (33, 40)])
def test_matches_f_linear(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    b = torch.randn(out_features, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def _layer(out_features: int, in_features: int) -> linear_mod.Linear:
    layer = linear_mod.Linear(in_features, out_features)
    layer.load_weight("weight", torch.randn(out_features, in_features))
    layer.process_weights_after_loading()
    return layer


@needs_kernel
def test_kernel_is_used_and_weight_packed_once(monkeypatch):
    """A layer's FloatLinearMethod packs its weight once (after loading) and keeps the panels on
    the layer; calls reuse them."""
    calls = []
    real = linear_mod._kernel()
    monkeypatch.setattr(linear_mod, "_kernel", lambda: real._replace(pack=lambda *a: calls.append(a) or real.pack(*a)))
    layer, x = _layer(8, 64), torch.randn(4, 64)
    assert layer.prepared is not None and layer.prepared.packed is not None
    for _ in range(3):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    assert len(calls) == 1


@needs_kernel
def test_in_place_weight_change_repacks():
    layer, x = _layer(16, 32), torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    first = layer.prepared
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 32))  # an in-place change of the parameter (its version moves)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)
    assert layer.prepared is not first  # a new form for the new values, kept on the layer
    torch.testing.assert_close(linear(x, layer.weight), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "x,w",
    [
        (torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)),
        (torch.randn(2, 3, 64), torch.randn(8, 64)),  # not 2-D
        (torch.randn(0, 64), torch.randn(8, 64)),  # no rows
    ],
)
def test_other_inputs_fall_back_to_torch(monkeypatch, x, w):
    monkeypatch.setattr(linear_mod, "_kernel", lambda: pytest.fail("the C kernel must not be used"))
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


def test_non_contiguous_input_and_weight():
    x = torch.randn(64, 6)[:, :4].t()  # [4, 64], not contiguous
    w = torch.randn(64, 8).t()  # [8, 64], not contiguous
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
