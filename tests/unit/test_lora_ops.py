"""The batched LoRA ops (lora/ops.py): the C kernel (kernels/lora.c) of every instruction-set
variant this CPU runs, the torch references and the public ops' dispatch and checks, against a
per-token float64 oracle.

Tolerance: float32 results against float64 products of the same inputs, elementwise within the
classic bound for a float32 sum of L rounded products, |y - y64| <= (L + 2) * 2**-24 *
(|x| @ |w|) (plus, for expand, one rounding of the added y). The kernels sum in another order
than torch, never in lower precision, so anything past that bound is a bug, not noise.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from pagedllm.kernels import build as kernel_build
from pagedllm.kernels import isa
from pagedllm.lora import ops
from pagedllm.lora.slot_segments import segments

U32 = 2.0 ** -24
HAVE_CC = shutil.which("gcc") is not None or shutil.which("cc") is not None


def _variants() -> list[str]:
    return [v.name for v in isa.runnable_variants()] if HAVE_CC else []


@pytest.fixture(autouse=True)
def _default_build(monkeypatch):
    monkeypatch.delenv(isa.MARCH_ENV, raising=False)
    monkeypatch.delenv(kernel_build.DISABLE_ENV, raising=False)
    monkeypatch.delenv("CC", raising=False)
    # another test may have left a compiler marked broken (tests of a missing CC): not ours
    monkeypatch.setattr(kernel_build, "_broken_compiler", None)


# ---- oracle and cases ---------------------------------------------------------------------------


def oracle_shrink(x, a, idx):
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t, s in enumerate(idx.tolist()):
        if s >= 0:
            out[t] = a[s].double() @ x[t].double()
            bound[t] = (x.shape[1] + 2) * U32 * (a[s].double().abs() @ x[t].double().abs())
    return out, bound


def oracle_expand(buf, b, idx, y, sizes):
    want = y.double().clone()
    bound = torch.zeros_like(want)
    R, row = b.shape[2], 0
    for i, n in enumerate(sizes):
        for t, s in enumerate(idx.tolist()):
            if s >= 0:
                w, v = b[s, row:row + n].double(), buf[t, i * R:(i + 1) * R].double()
                want[t, row:row + n] += w @ v
                bound[t, row:row + n] = (R + 2) * U32 * (w.abs() @ v.abs()) + U32 * want[t, row:row + n].abs()
        row += n
    return want, bound


def assert_within(got, want, bound):
    err = (got.double() - want).abs()
    excess = float((err - bound).max()) if err.numel() else 0.0
    assert excess <= 1e-30, f"max excess over the float32 bound {excess:.3g} (max error {float(err.max()):.3g})"


def make_indices(T, S, pattern, g):
    if pattern == "random":  # -1 included
        return torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    if pattern == "same":
        return torch.full((T,), S - 1, dtype=torch.int32)
    if pattern == "base":
        return torch.full((T,), -1, dtype=torch.int32)
    # runs: a long prompt of one adapter, decode tokens mixed, another prompt, base tokens
    idx = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    idx[: T // 2] = 0
    idx[T // 2 + 3: T // 2 + 3 + T // 4] = S - 1
    return idx


def make_stack(S, rows_per_slice, n_slices, max_rank, L, ranks, g, rank_axis):
    """[S, n_slices * max_rank, L] (rank_axis 1: A) or [S, N, max_rank] (B), each slot's rank
    ranks[s % len(ranks)] and zeros past it, as the loader pads them."""
    if rank_axis == 1:
        w = torch.randn(S, n_slices, max_rank, L, generator=g)
        for s in range(S):
            w[s, :, ranks[s % len(ranks)]:] = 0
        return w.view(S, n_slices * max_rank, L)
    w = torch.randn(S, rows_per_slice, max_rank, generator=g)
    for s in range(S):
        w[s, :, ranks[s % len(ranks)]:] = 0
    return w


# (T, K, sizes, max_rank, ranks): odd sizes, ranks off the vector width, 1/2/3 slices; T 33 and
# 70 have runs long enough for the panel path (16+ tokens), the others only dot tiles
CASES = [
    (1, 576, [576], 8, [8]),
    (7, 100, [30, 17, 5], 12, [12, 8]),
    (33, 64, [64, 64], 64, [16, 64]),
    (5, 33, [3], 5, [5]),
    (70, 96, [40, 24, 24], 16, [8, 12, 16]),
    (19, 1536, [576], 16, [16]),
]


def _case(T, K, sizes, max_rank, ranks, pattern, seed, S=4):
    g = torch.Generator().manual_seed(seed)
    n, N = len(sizes), sum(sizes)
    a = make_stack(S, None, n, max_rank, K, ranks, g, 1)
    b = make_stack(S, N, n, max_rank, None, ranks, g, 2)
    return (torch.randn(T, K, generator=g), a, torch.randn(T, n * max_rank, generator=g), b,
            torch.randn(T, N, generator=g), make_indices(T, S, pattern, g))


# ---- the C kernel, every variant ---------------------------------------------------------------


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("variant", _variants())
def test_every_variant_matches_float64(variant):
    kernel = kernel_build.lora_kernel(variant)
    assert kernel is not None, kernel_build.kernel_state("lora.c", variant).reason
    for c, (T, K, sizes, max_rank, ranks) in enumerate(CASES):
        for p, pattern in enumerate(("random", "same", "base", "runs")):
            x, a, buf, b, y, idx = _case(T, K, sizes, max_rank, ranks, pattern, seed=10 * c + p)
            out = torch.full((T, a.shape[1]), float("nan"))  # every row is written, zeros for -1
            ops.shrink_c(kernel, x, a, idx, out)
            assert_within(out, *oracle_shrink(x, a, idx))
            want = oracle_expand(buf, b, idx, y, sizes)
            ops.expand_c(kernel, buf, b, idx, y, sizes)
            assert_within(y, *want)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_kernel_refuses_an_index_out_of_range_and_writes_nothing():
    """The kernel checks the indices itself too (before any write), whatever its caller did."""
    kernel = kernel_build.lora_kernel()
    x, a = torch.randn(3, 8), torch.randn(2, 4, 8)
    out = torch.full((3, 4), 7.0)
    sizes = (ctypes.c_int64 * 1)(4)
    for bad in (2, -2):
        idx = torch.tensor([0, bad, 1], dtype=torch.int32)
        rc = kernel.sgmv(x.data_ptr(), 8, a.data_ptr(), 2, 8, out.data_ptr(), 4, 3, idx.data_ptr(), 1, sizes, 0, 1)
        assert rc == 3 and bool((out == 7.0).all())


def test_expand_writes_only_its_slice_rows_and_tokens():
    """y a row-strided view inside a NaN guard: the guard stays NaN; base-model rows keep their
    bits; a slice whose buf columns are zero keeps its rows exactly."""
    g = torch.Generator().manual_seed(3)
    sizes, R, S, T = [40, 24, 24], 16, 3, 37
    b = torch.randn(S, sum(sizes), R, generator=g)
    idx = torch.tensor([-1, 2] * 18 + [0], dtype=torch.int32)
    idx[5:30] = 1  # a long run: the panel path too
    idx[7] = -1
    buf = torch.randn(T, 3 * R, generator=g)
    buf[:, R:2 * R] = 0  # slice 1 adds nothing
    big = torch.full((T + 2, sum(sizes) + 9), float("nan"))
    y = big[1:T + 1, 4:4 + sum(sizes)]
    y.copy_(torch.randn(T, sum(sizes), generator=g))
    before = y.clone()
    ops.lora_expand(buf, b, idx, y, sizes)
    guard = big.clone()
    guard[1:T + 1, 4:4 + sum(sizes)] = 0
    assert bool(guard.isnan().sum() == big.numel() - y.numel())
    base = idx == -1
    assert torch.equal(y[base], before[base])
    assert torch.equal(y[:, 40:64], before[:, 40:64])
    assert not torch.equal(y[~base][:, :40], before[~base][:, :40])
    assert_within(y, *oracle_expand(buf, b, idx, before, sizes))


# ---- the public ops: dispatch, references, layouts ----------------------------------------------


@pytest.mark.parametrize("path", ["c", "reference", "float64"])
def test_public_ops_on_each_path(monkeypatch, path):
    if path == "reference":
        monkeypatch.setattr(ops, "lora_kernel", lambda: None)  # as without a compiler
    elif path == "c" and kernel_build.lora_kernel() is None:
        pytest.skip("the C kernel is not built here")
    dtype = torch.float64 if path == "float64" else torch.float32
    # "same" from 16 / 256 / 512 (three slices) tokens: the single-slot torch GEMM
    # (SINGLE_SLOT_TORCH_MIN_TOKENS)
    cases = [(case, pattern) for case in [*CASES[:5], (300, 24, [16, 8], 8, [8]),
                                          (520, 16, [8, 4, 4], 4, [4])]
             for pattern in ("runs", "same", "base")]
    for c, ((T, K, sizes, max_rank, ranks), pattern) in enumerate(cases):
        x, a, buf, b, y, idx = (t.to(dtype) if t.is_floating_point() else t
                                for t in _case(T, K, sizes, max_rank, ranks, pattern, seed=c))
        want_out, bound_out = oracle_shrink(x, a, idx)
        want_y, bound_y = oracle_expand(buf, b, idx, y, sizes)
        out = ops.lora_shrink(x, a, idx)
        ops.lora_expand(buf, b, idx, y, sizes)
        assert out.dtype == dtype and y.dtype == dtype
        assert_within(out, want_out, bound_out)
        assert_within(y, want_y, bound_y)


def test_references_match_the_oracle_in_float64():
    x, a, buf, b, y, idx = (t.double() if t.is_floating_point() else t
                            for t in _case(23, 40, [20, 12], 8, [8, 4], "random", seed=5))
    torch.testing.assert_close(ops.lora_shrink_reference(x, a, idx), oracle_shrink(x, a, idx)[0], rtol=0, atol=1e-12)
    want = oracle_expand(buf, b, idx, y, [20, 12])[0]
    ops.lora_expand_reference(buf, b, idx, y, [20, 12])
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)


def test_strided_views_and_given_out():
    """x / out / y as views (row-strided, transposed): the same results as contiguous tensors."""
    x, a, buf, b, y, idx = _case(9, 48, [32, 16], 8, [8], "random", seed=7)
    out_t = torch.empty(a.shape[1], 9).T  # column-strided: computed through a copy
    got = ops.lora_shrink(torch.cat([x, x], 1)[:, :48], a, idx, out=out_t)
    assert got is out_t
    assert_within(out_t, *oracle_shrink(x, a, idx))
    yt = y.T.contiguous().T  # column-strided y
    want = oracle_expand(buf, b, idx, y, [32, 16])
    ops.lora_expand(buf, b, idx, yt, [32, 16])
    assert_within(yt, *want)


def test_no_tokens():
    a, b = torch.randn(2, 8, 16), torch.randn(2, 24, 8)
    idx = torch.zeros(0, dtype=torch.int32)
    assert ops.lora_shrink(torch.zeros(0, 16), a, idx).shape == (0, 8)
    y = torch.zeros(0, 24)
    ops.lora_expand(torch.zeros(0, 8), b, idx, y, [24])
    assert ops.lora_shrink_reference(torch.zeros(0, 16), a, idx).shape == (0, 8)


def test_segments_group_tokens_by_slot_stably():
    idx = torch.tensor([2, -1, 0, 2, 2, -1, 0], dtype=torch.int32)
    seg = segments(idx, 4)
    assert seg.order.tolist() == [1, 5, 2, 6, 0, 3, 4]
    assert seg.starts.tolist() == [0, 2, 4, 4, 7, 7]  # slot 1 and slot 3: empty segments
    assert seg.slots.tolist() == [-1, 0, 1, 2, 3]
    empty = segments(torch.zeros(0, dtype=torch.int32), 2)
    assert empty.order.numel() == 0 and empty.starts.tolist() == [0, 0, 0, 0]


# ---- checks -------------------------------------------------------------------------------------

_I = torch.tensor([0, -1, 1], dtype=torch.int32)


@pytest.mark.parametrize("args,match", [
    (dict(x=torch.randn(3, 8, dtype=torch.float64)), "a_stack has dtype torch.float32 but x has torch.float64"),
    (dict(x=torch.randn(3, 9)), r"a_stack \(2, 4, 8\) must be \[slots, Rt, 9\]"),
    (dict(x=torch.randn(3, 8, 1)), r"x must have 2 dimensions, got shape \(3, 8, 1\)"),
    (dict(x=torch.ones(3, 8, dtype=torch.int32)), "x must be a floating-point tensor, got torch.int32"),
    (dict(a_stack=[1]), "a_stack must be a torch.Tensor, got list"),
    (dict(indices=torch.tensor([0, 1, 2], dtype=torch.int32)), r"indices must lie in -1..1 .* got 2 at token 2"),
    (dict(indices=torch.tensor([0, -3, 1], dtype=torch.int32)), r"indices must lie in -1..1 .* got -3 at token 1"),
    (dict(indices=_I.long()), r"indices must be an int32 tensor \[3\] .* got torch.int64"),
    (dict(indices=_I[:2]), r"indices must be an int32 tensor \[3\] .* got torch.int32 \(2,\)"),
    (dict(out=torch.empty(3, 5)), r"out must be \[3, 4\], got \(3, 5\)"),
    (dict(out=torch.empty(3, 4, dtype=torch.float64)), "out has dtype torch.float64 but x has torch.float32"),
    (dict(a_stack=torch.randn(0, 4, 8)), r"a_stack \(0, 4, 8\) needs at least one slot and one rank row"),
])
def test_shrink_errors(args, match):
    full = dict(x=torch.randn(3, 8), a_stack=torch.randn(2, 4, 8), indices=_I, out=None)
    full.update(args)
    with pytest.raises(ValueError, match="lora_shrink: " + match):
        ops.lora_shrink(**full)


@pytest.mark.parametrize("args,match", [
    (dict(slice_sizes=[10, 10]), r"slice_sizes \[10, 10\] must be positive and sum to b_stack's 24 rows"),
    (dict(slice_sizes=[24, 0]), r"slice_sizes \[24, 0\] must be positive"),
    (dict(slice_sizes=None), "slice_sizes must be a sequence of ints, got None"),
    (dict(slice_sizes=[12, 12]), r"buf has 8 columns but b_stack \(2, 24, 8\) with 2 slices needs 2 x 8 = 16"),
    (dict(y=torch.zeros(3, 25)), r"y must be \[3, 24\], got \(3, 25\)"),
    (dict(y=torch.zeros(3, 24, dtype=torch.float16)), "y has dtype torch.float16 but buf has torch.float32"),
    (dict(indices=torch.tensor([0, 5, 1], dtype=torch.int32)), "indices must lie in -1..1 .* got 5 at token 1"),
    (dict(buf=torch.zeros(3, 8, device="meta")), "b_stack is on cpu but buf is on meta"),
])
def test_expand_errors(args, match):
    full = dict(buf=torch.randn(3, 8), b_stack=torch.randn(2, 24, 8), indices=_I, y=torch.zeros(3, 24),
                slice_sizes=[24])
    full.update(args)
    with pytest.raises(ValueError, match="lora_expand: " + match):
        ops.lora_expand(**full)
