"""Integer weights kept packed for kernels/int_gemm.c, and the product `x @ W^T` on them.

Every integer format pagedllm loads (GPTQ, AWQ, compressed-tensors, GGUF Q4_0 / Q4_1 / Q8_0)
becomes `W[n, k] = d[n, g] * q[n, k] + m[n, g]` with unsigned codes `q` of 4 or 8 bits in groups
`g` of `group_size` consecutive k: `m = -d * zero` (given as uint8 zero points) or a float `m`
(GGUF's Q4_1). `pack_int_weight` lays that out once after loading (0.53-0.75 bytes a weight at
4 bits, about a quarter of float16); `int_matmul` then runs one of two arithmetic paths:
- "exact": unpacked to float32 in registers, float32 FMAs: dequantize-then-matmul's products;
- "int8": activations quantized to int8 per block of 32 k, integer dot products (VNNI).
`int_gemm_isa()` names the instruction set the kernel was built for.

`with_choice` gives the weight its per-bucket paths (layers/kernel_choice.py): the asked path,
except under `PAGEDLLM_KERNEL_CHOICE=torch` (an A/B switch), where the layer keeps a float32 copy
for `F.linear` (at most `FLOAT_COPY_BUDGET` bytes of such copies per process). The default never
keeps a float32 copy of a quantized weight: it would cost 4-8x the packed bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.kernels import int_gemm_kernel
from pagedllm.layers import kernel_choice
from pagedllm.layers.eager_in_graphs import eager_in_graphs

OFFSET_ZERO, OFFSET_MIN = 0, 1  # kernels/int_gemm.c's kinds of offset
KBLOCK = 32  # the kernel's activation block: group sizes are multiples of it
COMPUTE_PATHS = ("exact", "int8")
ISA_NAMES = {4: "avx512", 3: "avx512-vnni", 2: "avx-vnni", 1: "avx2", 0: "portable"}
FLOAT_COPY_BUDGET = 1 << 30  # bytes of float32 copies kept for buckets where torch is faster
_float_copy_bytes = 0
_X_CHUNK_ROWS = 144  # packed_gemm.c's M_CHUNK: the exact path's scratch holds one chunk
_PANEL_MIN_ROWS = 17  # int_gemm.c's PANEL_MIN_ROWS: fewer rows need no scratch


class PackedIntWeight(NamedTuple):
    data: torch.Tensor  # uint8, int_gemm.c's layout
    bits: int
    kind: int  # OFFSET_ZERO or OFFSET_MIN
    out_features: int  # N
    in_features: int  # K
    group_size: int  # a multiple of 32 dividing K (per channel: K)
    paths: "kernel_choice.Choice | None" = None  # per batch bucket: "exact" / "int8" / "torch" (with_choice)
    float_weight: torch.Tensor | None = None  # the float32 weight, kept only where "torch" is a path


def int_gemm_isa() -> str | None:
    """The instruction set the integer kernel runs on here, or None without the kernel."""
    kernel = int_gemm_kernel()
    return None if kernel is None else ISA_NAMES.get(kernel.isa(), "unknown")


def kernel_supports(bits: int, in_features: int, group_size: int) -> bool:
    """Whether int_gemm.c takes this shape (else the caller keeps its portable path)."""
    return (int_gemm_kernel() is not None and bits in (4, 8) and group_size >= KBLOCK
            and group_size % KBLOCK == 0 and in_features % group_size == 0)


@torch.no_grad()
def pack_int_weight(codes: torch.Tensor, d: torch.Tensor, offsets: torch.Tensor, bits: int,
                    group_size: int) -> PackedIntWeight:
    """Pack `codes [N, K]` (0 .. 2**bits - 1), `d [N, K / group_size]` and `offsets` of the same
    shape (uint8 zero points, or floating `m`). ValueError for shapes the kernel does not take."""
    kernel = int_gemm_kernel()
    if kernel is None:
        raise RuntimeError("the int_gemm C kernel is not available (see `pagedllm --version`)")
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [out, in], got shape {tuple(codes.shape)}")
    n, k = codes.shape
    if not kernel_supports(bits, k, group_size):
        raise ValueError(f"int_gemm takes 4 or 8 bits and group sizes that are multiples of {KBLOCK} "
                         f"dividing the input size; got bits={bits}, group_size={group_size}, in={k}")
    groups = k // group_size
    if tuple(d.shape) != (n, groups) or tuple(offsets.shape) != (n, groups):
        raise ValueError(f"scales {tuple(d.shape)} and offsets {tuple(offsets.shape)} must both be "
                         f"({n}, {groups}) for codes {tuple(codes.shape)} in groups of {group_size}")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes must be below {1 << bits} for {bits} bits, got {int(codes.max())}")
    kind = OFFSET_ZERO if offsets.dtype == torch.uint8 else OFFSET_MIN
    q = codes.to(torch.uint8).contiguous()
    dd = d.to(torch.float32).contiguous()
    off = offsets.contiguous() if kind == OFFSET_ZERO else offsets.to(torch.float32).contiguous()
    out = torch.empty(kernel.packed_size(bits, kind, n, k, group_size), dtype=torch.uint8)
    if kernel.pack(bits, kind, q.data_ptr(), dd.data_ptr(), off.data_ptr(), out.data_ptr(), n, k, group_size):
        raise ValueError("int_gemm_pack refused its arguments")
    return PackedIntWeight(out, bits, kind, n, k, group_size)


@eager_in_graphs
def unpack_int_weight(w: PackedIntWeight) -> torch.Tensor:
    """The float32 weight `[N, K]` the packed form stands for (exactly what the exact path uses)."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
    failed = int_gemm_kernel().unpack(w.bits, w.kind, w.data.data_ptr(), out.data_ptr(),
                                      w.out_features, w.in_features, w.group_size)
    if failed:
        raise MemoryError("int_gemm_unpack could not allocate its panel buffer")
    return out


@eager_in_graphs
def int_weight_rows(w: PackedIntWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W as float32 `[*ids.shape, K]` (an embedding lookup from the packed form)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), w.in_features, dtype=torch.float32)
    failed = int_gemm_kernel().rows(w.bits, w.kind, w.data.data_ptr(), flat.data_ptr(), flat.numel(),
                                    out.data_ptr(), w.out_features, w.in_features, w.group_size)
    if failed == 3:
        raise IndexError(f"token id out of range 0..{w.out_features - 1}")
    if failed:
        raise ValueError("int_gemm_rows refused its arguments")
    return out.view(*ids.shape, w.in_features)


def _int_matmul(x: torch.Tensor, w: PackedIntWeight, compute: str = "exact") -> torch.Tensor:
    """`x @ W^T` for float32 CPU `x [M, K]`."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"int_matmul takes a 2-D float32 CPU input, got {tuple(x.shape)} {x.dtype} on {x.device}")
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"int_matmul: the input has {k} in-features, the weight takes {w.in_features}")
    if compute not in COMPUTE_PATHS:
        raise ValueError(f"compute must be one of {list(COMPUTE_PATHS)}, got {compute!r}")
    n = w.out_features
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    kernel = int_gemm_kernel()
    x = x.contiguous()
    threads = torch.get_num_threads()
    if compute == "exact":
        # the scratch holds packed rows from _PANEL_MIN_ROWS on (int_gemm.c's PANEL_MIN_ROWS)
        scratch = torch.empty(min(m, _X_CHUNK_ROWS) * k, dtype=torch.float32) if m >= _PANEL_MIN_ROWS else None
        failed = kernel.exact(w.bits, w.kind, x.data_ptr(), w.data.data_ptr(), out.data_ptr(),
                              0 if scratch is None else scratch.data_ptr(), m, n, k, w.group_size, threads)
    else:
        scratch = torch.empty(kernel.int8_scratch(m, k), dtype=torch.uint8)
        failed = kernel.int8(w.bits, w.kind, x.data_ptr(), w.data.data_ptr(), out.data_ptr(),
                             scratch.data_ptr(), m, n, k, w.group_size, threads)
    if failed:
        raise MemoryError(f"int_gemm ({compute}) failed with code {failed}")
    return out


# A ctypes call: runs eagerly inside compiled graphs. Eager callers on the hot path use
# `_int_matmul` directly (once compiling, the disable wrapper costs about 2 us a call).
int_matmul = eager_in_graphs(_int_matmul)


@eager_in_graphs  # measures eagerly, also when first reached inside a compiled graph
def with_choice(w: PackedIntWeight, compute: str) -> PackedIntWeight:
    """`w` with its per-bucket paths: `compute` ("exact" / "int8") or torch's `F.linear` on the
    float32 weight, whichever this machine runs faster (layers/kernel_choice.py)."""
    global _float_copy_bytes
    if compute not in COMPUTE_PATHS:
        raise ValueError(f"compute must be one of {list(COMPUTE_PATHS)}, got {compute!r}")
    n, k = w.out_features, w.in_features
    copy_bytes = 4 * n * k
    candidates = {compute: lambda x: int_matmul(x, w, compute)}
    dense = None
    if kernel_choice.mode() == "torch" and _float_copy_bytes + copy_bytes <= FLOAT_COPY_BUDGET:
        dense = unpack_int_weight(w)
        candidates["torch"] = lambda x: F.linear(x, dense)
    key = f"int{w.bits} g{w.group_size} kind{w.kind} {compute} {n}x{k}"
    paths = kernel_choice.choose(key, candidates, k, default=compute, out_features=n)
    if "torch" in paths:
        _float_copy_bytes += copy_bytes
        return w._replace(paths=paths, float_weight=dense)
    return w._replace(paths=paths)


def int_linear(x: torch.Tensor, w: PackedIntWeight, compute: str) -> torch.Tensor:
    """`x @ W^T` for float32 CPU `x [M, K]` by the path `w` keeps for M rows (`compute` when no
    choice was made)."""
    bucket = kernel_choice.bucket_index(x.shape[0])
    path = compute if w.paths is None else w.paths[bucket]
    if path == "torch":
        if isinstance(w.paths, kernel_choice.Choice):
            w.paths.recheck_if_due(bucket, lambda: F.linear(x, w.float_weight), lambda: _int_matmul(x, w, compute))
        return F.linear(x, w.float_weight)
    return int_matmul(x, w, path) if torch.compiler.is_compiling() else _int_matmul(x, w, path)
