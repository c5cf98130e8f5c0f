"""The GPU path of the batched LoRA ops (lora/ops.py): Triton shrink and expand kernels, SGMV
style: the batch's tokens grouped by adapter slot (`slot_segments.segments`: a stable sort, no data
copy: the kernels gather x's rows and scatter their outputs through the order), each program a
`[BLOCK_M tokens of one slot] x [BLOCK_N outputs]` tile accumulated by `tl.dot` in float32 over
the reduction axis (K for shrink, R for expand), so a slot's A / B tile is read once per tile
of its tokens whatever the batch order.

No host synchronisation (CUDA-graph friendly): the segment table has a fixed size (S + 1
segments, slot -1 first, empty ones allowed), and the grid is an upper bound on the tiles,
`cdiv(T, BLOCK_M) + S + 1` programs along the tokens; each program reads its segment from a
table torch builds beforehand (`searchsorted` over the segments' tile offsets), and a program
past the last tile does nothing.
Shrink writes every token's row (zeros for slot -1); expand adds to y only the rows and
columns of its own tile (one program per element: no atomics) and launches once per slice
(1-3 launches), each slice reading its own R columns of buf.

Float32 inputs multiply in IEEE float32 (no TF32); float16 / bfloat16 inputs use the tensor
cores with a float32 accumulator. Triton is optional: this module imports without it
(`HAS_TRITON` False; the functions raise). With `TRITON_INTERPRET=1` the kernels run in
Triton's interpreter on CPU tensors (the tests), jitted per mode as in
quantization/triton_int_gemm.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm import envs
from pagedllm.lora.slot_segments import segments

try:  # optional: the CPU install has no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None


if HAS_TRITON:

    def _tile_of(pid, tile_seg_ptr, tile_starts_ptr, starts_ptr, order_ptr, NUM_SEGS: tl.constexpr,
                 BLOCK_M: tl.constexpr):
        """(token ids of this program's tile, their mask, the tile's slot): tile_seg[pid] is the
        tile's segment (NUM_SEGS past the last tile), whose tiles start at tile_starts[j]."""
        j = tl.load(tile_seg_ptr + pid)
        valid = j < NUM_SEGS
        j = tl.minimum(j, NUM_SEGS - 1)
        seg_start = tl.load(starts_ptr + j)
        seg_end = tl.load(starts_ptr + j + 1)
        rows = seg_start + (pid - tl.load(tile_starts_ptr + j)) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = (rows < seg_end) & valid
        tokens = tl.load(order_ptr + rows, mask=m_mask, other=0)
        return tokens, m_mask, j - 1

    def _shrink_kernel(
        x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, tile_starts_ptr, tile_seg_ptr,
        K, Rt, stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot, stride_or,
        NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        tokens, m_mask, slot = _tile_of(tl.program_id(0), tile_seg_ptr, tile_starts_ptr, starts_ptr, order_ptr,
                                        NUM_SEGS, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < Rt
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as
        k_end = tl.where(slot >= 0, K, 0)  # slot -1: no product, the row is stored as zeros
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xt = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_xt + offs_k[None, :] * stride_xk,
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_base + offs_n[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(xt, at, acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, at, acc)
        out = out_ptr + tokens[:, None].to(tl.int64) * stride_ot + offs_n[None, :] * stride_or
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    def _expand_kernel(
        buf_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, tile_starts_ptr, tile_seg_ptr,
        R, n_rows, row0, col0, stride_bt, stride_br, stride_bs, stride_bn, stride_bk, stride_yt, stride_yn,
        NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        tokens, m_mask, slot = _tile_of(tl.program_id(0), tile_seg_ptr, tile_starts_ptr, starts_ptr, order_ptr,
                                        NUM_SEGS, BLOCK_M)
        m_mask = m_mask & (slot >= 0)  # base-model tokens: y untouched
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_rows
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        b_base = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + row0 * stride_bn
        r_end = tl.where(slot >= 0, R, 0)
        for k0 in range(0, r_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < R
            bt = tl.load(buf_ptr + tokens[:, None].to(tl.int64) * stride_bt + (col0 + offs_k[None, :]) * stride_br,
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(bt, wt, acc, input_precision="ieee")
            else:
                acc = tl.dot(bt, wt, acc)
        mask = m_mask[:, None] & n_mask[None, :]
        ys = y_ptr + tokens[:, None].to(tl.int64) * stride_yt + (row0 + offs_n[None, :]) * stride_yn
        y = tl.load(ys, mask=mask, other=0.0)
        tl.store(ys, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)

_KERNELS: dict[tuple[str, bool], object] = {}
_TILE_OF_PY = _tile_of if HAS_TRITON else None


def _kernel(name: str):
    """The jitted kernel for the current mode (compiled, or the interpreter's), made on first
    use: Triton decides between the two when `triton.jit` runs. The kernels call `_tile_of`
    by its global name, read when a kernel compiles (or, interpreted, runs): it is pointed at
    the helper of the mode first (jitted for the compiler, plain Python for the interpreter)."""
    mode = envs.TRITON_INTERPRET
    key = (name, mode)
    if key not in _KERNELS:
        _KERNELS[key] = triton.jit({"shrink": _shrink_kernel, "expand": _expand_kernel}[name])
    if ("tile_of", mode) not in _KERNELS:
        _KERNELS[("tile_of", mode)] = _TILE_OF_PY if mode else triton.jit(_TILE_OF_PY)
    globals()["_tile_of"] = _KERNELS[("tile_of", mode)]
    return _KERNELS[key]


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _block_m(T: int) -> int:
    return 16 if T <= 16 else 32 if T <= 64 else 64


def _tiles(indices: torch.Tensor, num_slots: int, block_m: int,
           grid_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, segment starts, segment tile starts, segment of each of the grid_m programs), on
    the indices' device, no host sync."""
    seg = segments(indices, num_slots)
    counts = seg.starts[1:] - seg.starts[:-1]
    tile_starts = torch.zeros_like(seg.starts)
    torch.cumsum((counts + block_m - 1) // block_m, 0, out=tile_starts[1:])
    programs = torch.arange(grid_m, device=indices.device)
    tile_seg = torch.searchsorted(tile_starts[1:], programs, right=True)  # num_slots + 1: no tile
    return seg.order, seg.starts, tile_starts, tile_seg


def _launch_checks(*tensors: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("lora triton ops: this needs the triton package (pip install triton); it is not "
                           "installed, and CPU inference does not use it")
    device = tensors[0].device
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(f"lora triton ops: tensors on {device} need TRITON_INTERPRET=1 (Triton's CPU "
                         "interpreter); the compiled kernels run on CUDA tensors")


def lora_shrink_triton(x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                       *, block_m: int | None = None) -> torch.Tensor:
    """`ops.lora_shrink` (arguments already checked there) into `out`."""
    _launch_checks(x, a_stack, indices, out)
    T, K = x.shape
    S, Rt, _ = a_stack.shape
    if T == 0:
        return out
    bm = block_m or _block_m(T)
    grid_m = triton.cdiv(T, bm) + S + 1  # at least the tiles: each segment adds at most one partial
    order, starts, tile_starts, tile_seg = _tiles(indices, S, bm, grid_m)
    bn = _pow2(Rt, 16, 64)
    _kernel("shrink")[(grid_m, triton.cdiv(Rt, bn))](
        x, a_stack, out, order, starts, tile_starts, tile_seg, K, Rt, x.stride(0), x.stride(1),
        a_stack.stride(0), a_stack.stride(1), a_stack.stride(2), out.stride(0), out.stride(1),
        NUM_SEGS=S + 1, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=_pow2(K, 16, 64), IEEE=x.dtype == torch.float32,
    )
    return out


def lora_expand_triton(buf: torch.Tensor, b_stack: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
                       slice_sizes: Sequence[int], *, block_m: int | None = None) -> None:
    """`ops.lora_expand` (arguments already checked there), in place on y."""
    _launch_checks(buf, b_stack, indices, y)
    T = buf.shape[0]
    S, _, R = b_stack.shape
    if T == 0:
        return
    bm = block_m or _block_m(T)
    grid_m = triton.cdiv(T, bm) + S + 1
    order, starts, tile_starts, tile_seg = _tiles(indices, S, bm, grid_m)
    row = 0
    for i, size in enumerate(slice_sizes):  # the layer's 1-3 slices, not the adapters
        bn = _pow2(size, 16, 64)
        _kernel("expand")[(grid_m, triton.cdiv(size, bn))](
            buf, b_stack, y, order, starts, tile_starts, tile_seg, R, size, row, i * R,
            buf.stride(0), buf.stride(1), b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
            y.stride(0), y.stride(1),
            NUM_SEGS=S + 1, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=_pow2(R, 16, 64), IEEE=buf.dtype == torch.float32,
        )
        row += size
