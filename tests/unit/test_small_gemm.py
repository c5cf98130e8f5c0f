"""The C small-batch GEMM behind every projection (`layers.linear.linear`) against `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import linear as linear_mod
from pagedllm.layers.linear import SMALL_GEMM_MAX_ROWS, linear

needs_kernel = pytest.mark.skipif(linear_mod._kernel() is None, reason="no C compiler: F.linear only")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 20, 33, SMALL_GEMM_MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (8, 64)])
def test_matches_f_linear(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    b = torch.randn(out_features, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_kernel_is_used_for_decode_shapes(monkeypatch):
    calls = []
    real = linear_mod._kernel()
    monkeypatch.setattr(linear_mod, "_kernel", lambda: lambda *a: calls.append(a) or real(*a))
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "x,w",
    [
        (torch.randn(4, 40), torch.randn(8, 40)),  # K not a multiple of 16
        (torch.randn(4, 64), torch.randn(6, 64)),  # N not a multiple of 4
        (torch.randn(SMALL_GEMM_MAX_ROWS + 1, 64), torch.randn(8, 64)),  # prefill-sized
        (torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)),
        (torch.randn(2, 3, 64), torch.randn(8, 64)),  # not 2-D
    ],
)
def test_other_shapes_fall_back_to_torch(monkeypatch, x, w):
    monkeypatch.setattr(linear_mod, "_kernel", lambda: pytest.fail("the C kernel must not be used"))
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


def test_non_contiguous_input(monkeypatch):
    x = torch.randn(64, 6)[:, :4].t()  # [4, 64], not contiguous
    w = torch.randn(8, 64)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
