"""The batched LoRA products of a layer (punica's BGMV / SGMV): one call per op for a batch whose
tokens use different adapters, or none, selected by a per-token slot index.

A LoRA layer computes `y += B @ (A @ x)` per token with its adapter's A `[r, K]` and B `[N, r]`.
The adapters resident in memory are stacked by slot (`max_loras` slots, ranks zero-padded to
`max_rank`), so that a batch needs no Python loop over adapters:
- `lora_shrink(x, a_stack, indices)`: `buf[t] = a_stack[indices[t]] @ x[t]`, zeros for base-model
  tokens (`indices[t] == -1`). A fused layer's slices (q/k/v, gate/up) have their A matrices
  concatenated along the rank axis: `Rt = n_slices * max_rank`.
- `lora_expand(buf, b_stack, indices, y, slice_sizes)`: in place, for slice i (rows
  `sum(slice_sizes[:i])` onwards of N), `y[t, rows] += b_stack[indices[t], rows, :] @
  buf[t, i*R:(i+1)*R]` with `R = Rt / n_slices`; base-model tokens are left untouched. The LoRA
  scaling is folded into B by the loader.

Dispatch, after validation (a ValueError naming the argument and value; the index range of
fewer than 16 tokens on the C path is checked by the kernel itself, before it writes anything):
- CPU float32: the C kernel `kernels/lora.c` (takes the indices as they are and tiles runs of
  equal consecutive indices itself: see there why it does not sort); a batch whose tokens all
  use one slot, from `SINGLE_SLOT_TORCH_MIN_TOKENS` tokens, takes torch's own GEMM on that
  slot's matrices instead (measured faster there, docs/lora.md); base-model-only batches skip
  the product (the index range, which the checks compute anyway, says both);
- CUDA: the Triton kernels of lora/triton_ops.py (tokens grouped by slot, slot_segments.py);
- anything else (no compiler, `PAGEDLLM_DISABLE_C_KERNELS=1`, other dtypes or devices, no
  Triton): the torch references below, vectorised over adapters.

Layouts: `x`, `buf`, `out` and `y` may be row-strided views (any row stride, unit column
stride) on the native paths; other views are computed through a contiguous copy. `a_stack` and
`b_stack` are read contiguous (a non-contiguous stack is copied per call: the loader keeps them
contiguous).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from pagedllm.kernels import lora_kernel


# ---- validation ---------------------------------------------------------------------------------


def _tensor(op: str, name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")
    return t


def _check_common(op: str, named: list[tuple[str, torch.Tensor]], indices: object, T: int,
                  S: int) -> tuple[int, int] | None:
    """One dtype and one device for every tensor; indices int32 [T] in -1..S-1. Returns the
    smallest and largest index (-1, -1 without tokens), or None for a few tokens on the C
    kernel's path: there the kernel checks the range itself before writing anything (code 3,
    turned into the same ValueError by `_index_error`), which saves a reduction and two host
    reads on every decode-sized call."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but {first_name} has {first.dtype}")
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or tuple(indices.shape) != (T,):
        got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"{op}: indices must be an int32 tensor [{T}] (one slot per token), got {got}")
    for name, t in [*named, ("indices", indices)]:
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
    if not T:
        return -1, -1
    if T < KERNEL_CHECKS_BELOW_TOKENS and _c_kernel(first) is not None:
        return None
    lo, hi = (int(v) for v in torch.aminmax(indices))
    if lo < -1 or hi >= S:
        _index_error(op, indices, S)
    return lo, hi


def _index_error(op: str, indices: torch.Tensor, S: int) -> None:
    """The ValueError for indices outside -1..S-1, naming the first bad one."""
    bad_at = torch.nonzero((indices < -1) | (indices >= S))
    at = int(bad_at[0, 0]) if len(bad_at) else -1
    raise ValueError(f"{op}: indices must lie in -1..{S - 1} (-1: base model; {S} adapter slots), "
                     f"got {int(indices[at]) if at >= 0 else '?'} at token {at}")


def _check_shrink(x: object, a_stack: object, indices: object, out: object) -> tuple[int, int, int, int]:
    op = "lora_shrink"
    x = _tensor(op, "x", x, 2)
    a_stack = _tensor(op, "a_stack", a_stack, 3)
    T, K = x.shape
    S, Rt, Ka = a_stack.shape
    if Ka != K:
        raise ValueError(f"{op}: a_stack {tuple(a_stack.shape)} must be [slots, Rt, {K}] (x has {K} columns)")
    if S < 1 or Rt < 1:
        raise ValueError(f"{op}: a_stack {tuple(a_stack.shape)} needs at least one slot and one rank row")
    named = [("x", x), ("a_stack", a_stack)]
    if out is not None:
        out = _tensor(op, "out", out, 2)
        if tuple(out.shape) != (T, Rt):
            raise ValueError(f"{op}: out must be [{T}, {Rt}], got {tuple(out.shape)}")
        named.append(("out", out))
    lo, hi = _check_common(op, named, indices, T, S) or (-2, -2)
    return T, Rt, lo, hi


def _check_expand(buf: object, b_stack: object, indices: object, y: object,
                  slice_sizes: object) -> tuple[int, int, int, list[int]]:
    op = "lora_expand"
    buf = _tensor(op, "buf", buf, 2)
    b_stack = _tensor(op, "b_stack", b_stack, 3)
    y = _tensor(op, "y", y, 2)
    T, Rt = buf.shape
    S, N, R = b_stack.shape
    try:
        sizes = [int(s) for s in slice_sizes]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"{op}: slice_sizes must be a sequence of ints, got {slice_sizes!r}") from None
    if not sizes or any(s < 1 for s in sizes) or sum(sizes) != N:
        raise ValueError(f"{op}: slice_sizes {sizes} must be positive and sum to b_stack's {N} rows")
    if S < 1 or R < 1 or Rt != len(sizes) * R:
        raise ValueError(f"{op}: buf has {Rt} columns but b_stack {tuple(b_stack.shape)} with {len(sizes)} "
                         f"slices needs {len(sizes)} x {R} = {len(sizes) * R}")
    if tuple(y.shape) != (T, N):
        raise ValueError(f"{op}: y must be [{T}, {N}], got {tuple(y.shape)}")
    lo, hi = _check_common(op, [("buf", buf), ("b_stack", b_stack), ("y", y)], indices, T, S) or (-2, -2)
    return R, lo, hi, sizes


# ---- the torch references -----------------------------------------------------------------------


def _used_slots(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots used by some token, each token's position among them, tokens with a slot)."""
    idx = indices.long()
    valid = idx >= 0
    used = torch.unique(idx[valid])
    where = torch.searchsorted(used, idx.clamp(min=0)).clamp(max=max(len(used) - 1, 0))
    return used, where, valid


def lora_shrink_reference(x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`lora_shrink` in plain torch, any dtype and device: one product of x against every used
    slot's A (U used slots: U times the multiply-adds of the per-token product, but one GEMM
    and no per-token copy of A), each token keeping its own slot's columns."""
    T, K = x.shape
    Rt = a_stack.shape[1]
    used, where, valid = _used_slots(indices)
    if len(used) == 0:
        return x.new_zeros(T, Rt)
    every = (x @ a_stack[used].reshape(-1, K).T).view(T, len(used), Rt)
    out = every[torch.arange(T, device=x.device), where]
    return out.masked_fill_(~valid[:, None], 0.0)


def lora_expand_reference(buf: torch.Tensor, b_stack: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
                          slice_sizes: Sequence[int]) -> None:
    """`lora_expand` in plain torch, in place on y (any view): each token's buf placed in its
    slot's batch of a bmm over the used slots (zeros elsewhere), summed over slots."""
    T = buf.shape[0]
    R = b_stack.shape[2]
    used, where, valid = _used_slots(indices)
    if len(used) == 0:
        return
    tokens = torch.nonzero(valid)[:, 0]
    placed = buf.new_zeros(len(used), T, buf.shape[1])
    placed[where[tokens], tokens] = buf[tokens]
    b = b_stack[used]
    row = 0
    for i, size in enumerate(slice_sizes):  # the layer's 1-3 slices, not the adapters
        part = torch.bmm(placed[:, :, i * R:(i + 1) * R], b[:, row:row + size, :].transpose(1, 2))
        y[:, row:row + size] += part.sum(0)
        row += size


# ---- the C kernel -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _c_sizes(sizes: tuple[int, ...]) -> ctypes.Array:
    """The slice sizes as the kernel's int64 array (a layer passes the same few every step)."""
    return (ctypes.c_int64 * len(sizes))(*sizes)


def _sgmv_c(kernel, x: torch.Tensor, w: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
            sizes: Sequence[int], accumulate: bool) -> None:
    """One `lora_sgmv` call (shapes already checked); y must have a unit column stride."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    if indices.stride(0) != 1:
        indices = indices.contiguous()
    rc = kernel.sgmv(x.data_ptr(), x.stride(0), w.data_ptr(), w.shape[0], w.shape[2], y.data_ptr(), y.stride(0),
                     x.shape[0], indices.data_ptr(), len(sizes), _c_sizes(tuple(sizes)), int(accumulate),
                     torch.get_num_threads())
    if rc == 3:
        _index_error("lora_shrink" if not accumulate else "lora_expand", indices, w.shape[0])
    if rc != 0:  # the checks make these unreachable; never leave a wrong result silently
        raise RuntimeError(f"lora_sgmv failed with code {rc} (1 bad sizes, 2 out of memory, 3 index out of range)")


def shrink_c(kernel, x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> None:
    """`lora_shrink` by a given `lora.c` library (benchmarks and tests pick the variant)."""
    target = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    _sgmv_c(kernel, x, a_stack, indices, target, (a_stack.shape[1],), False)
    if target is not out:
        out.copy_(target)


def expand_c(kernel, buf: torch.Tensor, b_stack: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
             slice_sizes: Sequence[int]) -> None:
    """`lora_expand` by a given `lora.c` library."""
    target = y if y.stride(1) == 1 else y.contiguous()
    _sgmv_c(kernel, buf, b_stack, indices, target, slice_sizes, True)
    if target is not y:
        y.copy_(target)


# ---- the public ops -----------------------------------------------------------------------------


def _c_kernel(t: torch.Tensor):
    """The C library if it applies to tensors like t (CPU float32, eager), else None."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    return lora_kernel()


def _vector_width(kernel) -> int:
    """Floats per vector of the loaded kernel build (4, 8 or 16; the portable build is 4)."""
    return int(kernel.vector_width())


def _triton(t: torch.Tensor):
    """lora/triton_ops.py if it applies to tensors like t (CUDA, Triton installed), else None."""
    if t.device.type != "cuda":
        return None
    from pagedllm.lora import triton_ops  # lazy: imports triton (optional, slow; CUDA only)

    return triton_ops if triton_ops.HAS_TRITON else None


# One slot for the whole batch (a single-adapter prefill or decode batch): from these many
# tokens torch's own GEMM on that slot's matrices beats the kernel on this project's machine
# (benchmarks/lora_ops.py, docs/lora.md), and needs no gather.
# A fused q/k/v expand (three slices, three small GEMMs for torch) stays on a vector build of
# the kernel longer: measured 1.9x (AVX-512) / 1.4-1.6x (AVX2) faster there from 16 to 256
# tokens (SmolLM2's qkv, rank 16); the portable build is slower than torch there.
SINGLE_SLOT_TORCH_MIN_TOKENS = {"shrink": 256, "expand": 16, "expand_3_slices": 512}
# Below this many tokens the C kernel's own index check replaces the reduction (see
# _check_common); the single-slot choice above starts at 16 tokens, so it always has the range.
KERNEL_CHECKS_BELOW_TOKENS = 16


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """`out[t] = a_stack[indices[t]] @ x[t]` (zeros where `indices[t] == -1`): x `[T, K]`,
    a_stack `[S, Rt, K]`, indices int32 `[T]`; out `[T, Rt]` (allocated if None). Returns out."""
    T, Rt, lo, hi = _check_shrink(x, a_stack, indices, out)
    if out is None:
        out = x.new_empty(T, Rt)
    return shrink_dispatch(x, a_stack, indices, out, lo, hi)


def shrink_dispatch(x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                    lo: int, hi: int) -> torch.Tensor:
    """`lora_shrink` after its checks: `lo` / `hi` the indices' range (-2: not read, the kernel
    checks it). The engine's layers call this with a range read once per step for every layer
    (lora/layers.LoRAStepContext), the shapes being theirs by construction."""
    T = x.shape[0]
    if T == 0:
        return out
    if hi == -1:  # base-model tokens only (-2: range not read, the kernel checks it)
        return out.zero_()
    kernel = _c_kernel(x)
    if kernel is not None and lo == hi and T >= SINGLE_SLOT_TORCH_MIN_TOKENS["shrink"]:
        torch.mm(x, a_stack[lo].T, out=out) if out.is_contiguous() else out.copy_(x @ a_stack[lo].T)
    elif kernel is not None:
        shrink_c(kernel, x, a_stack, indices, out)
    elif (tops := _triton(x)) is not None:
        tops.lora_shrink_triton(x, a_stack, indices, out)
    else:
        out.copy_(lora_shrink_reference(x, a_stack, indices))
    return out


def lora_expand(buf: torch.Tensor, b_stack: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
                slice_sizes: Sequence[int]) -> None:
    """In place: `y[t, slice i] += b_stack[indices[t], slice i rows, :] @ buf[t, i*R:(i+1)*R]`
    for tokens with an index >= 0; buf `[T, n_slices * R]`, b_stack `[S, N, R]`, y `[T, N]`,
    slice_sizes: the slices' row counts (sum N)."""
    R, lo, hi, sizes = _check_expand(buf, b_stack, indices, y, slice_sizes)
    expand_dispatch(buf, b_stack, indices, y, sizes, lo, hi)


def expand_dispatch(buf: torch.Tensor, b_stack: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
                    sizes: Sequence[int], lo: int, hi: int) -> None:
    """`lora_expand` after its checks (see `shrink_dispatch`)."""
    R = b_stack.shape[2]
    if hi == -1:  # no tokens, or base-model tokens only (-2: range not read, the kernel checks it)
        return
    kernel = _c_kernel(y)
    wide = kernel is not None and len(sizes) >= 3 and _vector_width(kernel) >= 8
    torch_from = SINGLE_SLOT_TORCH_MIN_TOKENS["expand_3_slices" if wide else "expand"]
    if kernel is not None and lo == hi and buf.shape[0] >= torch_from:
        row = 0
        for i, n in enumerate(sizes):  # the layer's 1-3 slices
            y[:, row:row + n].addmm_(buf[:, i * R:(i + 1) * R], b_stack[lo, row:row + n].T)
            row += n
    elif kernel is not None:
        expand_c(kernel, buf, b_stack, indices, y, sizes)
    elif (tops := _triton(y)) is not None:
        tops.lora_expand_triton(buf, b_stack, indices, y, sizes)
    else:
        lora_expand_reference(buf, b_stack, indices, y, sizes)
