"""GGUF matrices kept in their file's own blocks, and the product `x @ W^T` on them (kernels/gguf_gemm.c).

Why in place: a Hub GGUF file is already the most compact form of its weights (Q4_K_M: 4.5-5
bits a weight); widening it to float32 made a 1.07 GB file take 17.9 GB. `GGUFTensor` is the
file's bytes for one matrix (a zero-copy view of the memory-mapped file where rows need no
reordering), so weights take the file's size. Every type of `TYPES` (legacy Q4_0 .. Q8_0, the
K-quants Q2_K .. Q6_K, IQ4_NL / IQ4_XS, and F16 / BF16 / F32) has an exact path (each weight
widened in registers to the float32 value llama.cpp's dequantization gives) and, for the
quantized ones, an int8 path (activations in int8 per 32, integer dot products).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm.kernels import gguf_gemm_kernel
from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor
from pagedllm.layers.eager_in_graphs import eager_in_graphs
from pagedllm.quantization.kernels.int_kernel import ISA_NAMES

logger = logging.getLogger(__name__)


# ggml's type numbers (gguf-py's GGMLQuantizationType): the types kernels/gguf_gemm.c reads.
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
         "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
FLOAT_TYPES = ("F32", "F16", "BF16")
_PANEL_ROWS = 17  # gguf_gemm.c's PANEL_ROWS: from here on the exact path needs scratch
_M_CHUNK = 144  # packed_gemm.c's M_CHUNK


class GGUFTensor(NamedTuple):
    """One matrix `[rows, cols]` as the file stores it: each row is `cols / block` blocks of
    `type_name` (`data` is uint8 `[rows, row bytes]`, often a view of the mapped file)."""

    data: torch.Tensor
    type_name: str
    shape: tuple[int, int]

    @property
    def type_id(self) -> int:
        return TYPES[self.type_name]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def permute_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "GGUFTensor":
        return self._replace(data=fn(self.data).contiguous())

    def narrow_rows(self, start: int, length: int) -> "GGUFTensor":
        return self._replace(data=self.data[start:start + length], shape=(length, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 values (what the exact path multiplies by)."""
        if kernel_takes(self.type_name, self.shape[1]):
            return gguf_rows(self, None)

        data = self.data.numpy()
        if self.type_name in ("F32", "F16"):
            data = data.view(np.float32 if self.type_name == "F32" else np.float16)
        return dequantize_tensor(data, GGMLQuantizationType[self.type_name]).float().reshape(self.shape)


def kernel_takes(type_name: str, cols: int) -> bool:
    """Whether gguf_gemm.c reads this type at this row length here."""
    kernel = gguf_gemm_kernel()
    if kernel is None or type_name not in TYPES:
        return False
    block = kernel.block_length(TYPES[type_name])
    return block > 0 and cols % block == 0


def gguf_isa() -> str | None:
    kernel = gguf_gemm_kernel()
    return None if kernel is None else ISA_NAMES.get(kernel.isa(), "unknown")


@eager_in_graphs
def gguf_rows(w: GGUFTensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Rows `ids` of W widened to float32 `[*ids.shape, cols]` (an embedding lookup); None: all."""
    rows, cols = w.shape
    flat = None if ids is None else ids.reshape(-1).to(torch.int64).contiguous()
    count = rows if flat is None else flat.numel()
    out = torch.empty(count, cols, dtype=torch.float32)
    data = w.data if w.data.is_contiguous() else w.data.contiguous()
    failed = gguf_gemm_kernel().rows(w.type_id, data.data_ptr(), 0 if flat is None else flat.data_ptr(), count,
                                     out.data_ptr(), rows, cols, torch.get_num_threads())
    if failed == 3:
        raise IndexError(f"token id out of range 0..{rows - 1}")
    if failed:
        raise ValueError(f"gguf_rows refused a {w.type_name} matrix of shape {w.shape}")
    return out if ids is None else out.view(*ids.shape, cols)


def _gguf_matmul(x: torch.Tensor, w: GGUFTensor, compute: str = "exact", out: torch.Tensor | None = None,
                 col: int = 0) -> torch.Tensor:
    """`x @ W^T` for float32 CPU `x [M, cols]`, written into `out[:, col:col + rows]` (a new
    `[M, rows]` tensor when `out` is None). `compute`: "exact" or "int8" (float types: exact)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"gguf_matmul takes a 2-D float32 CPU input, got {tuple(x.shape)} {x.dtype} on {x.device}")
    m, k = x.shape
    n, cols = w.shape
    if k != cols:
        raise ValueError(f"gguf_matmul: the input has {k} in-features, the weight takes {cols}")
    if out is None:
        out, col = torch.empty(m, n, dtype=torch.float32), 0
    if m == 0:
        return out
    if not out.is_contiguous() or out.shape[0] != m or col + n > out.shape[1]:
        raise ValueError("gguf_matmul: `out` must be a contiguous [M, >= col + rows] float32 tensor")
    kernel = gguf_gemm_kernel()
    x = x.contiguous()
    threads = torch.get_num_threads()
    y = out.data_ptr() + 4 * col
    if compute == "int8" and w.type_name not in FLOAT_TYPES:
        scratch = torch.empty(kernel.int8_scratch(m, k), dtype=torch.uint8)
        failed = kernel.int8(w.type_id, x.data_ptr(), w.data.data_ptr(), y, scratch.data_ptr(), m, n, k,
                             out.shape[1], threads)
    elif compute in ("exact", "int8"):
        scratch = torch.empty(min(m, _M_CHUNK) * k, dtype=torch.float32) if m >= _PANEL_ROWS else None
        failed = kernel.exact(w.type_id, x.data_ptr(), w.data.data_ptr(), y,
                              0 if scratch is None else scratch.data_ptr(), m, n, k, out.shape[1], threads)
    else:
        raise ValueError(f"compute must be 'exact' or 'int8', got {compute!r}")
    if failed:
        raise MemoryError(f"gguf_gemm ({compute}, {w.type_name} {w.shape}) failed with code {failed}")
    return out


gguf_matmul = eager_in_graphs(_gguf_matmul)  # a ctypes call: eager inside compiled graphs


@functools.cache  # once per (type, compute): the answer never changes, and this runs every step
def part_compute(type_name: str, compute: str) -> str:
    """The path a layer part of `type_name` takes for the asked `compute`: "int8" only where the
    kernel has a vector int8 kernel for the type (Q4_K / Q6_K on AVX-512); elsewhere its generic
    int8 loop is slower than the exact path, so such parts run exact (logged once per type)."""
    if compute != "int8" or type_name in FLOAT_TYPES:
        return "exact"
    if gguf_gemm_kernel().int8_vectorized(TYPES[type_name]):
        return "int8"
    logger.info("quant_compute=int8: GGUF %s parts run the exact path (no vector int8 kernel for %s in this "
                "build; Q4_K / Q6_K and the Q4_0 / Q4_1 / Q8_0 layers of int_gemm.c have one)", type_name, type_name)
    return "exact"


def gguf_linear(x: torch.Tensor, shards: list[GGUFTensor], compute: str) -> torch.Tensor:
    """`x @ W^T` where W is the row-concatenation of `shards` (a fused q/k/v or gate/up layer
    whose parts may be of different types): each part writes its own columns of one output."""
    m = x.shape[0]
    out = torch.empty(m, sum(s.shape[0] for s in shards), dtype=torch.float32)
    matmul = gguf_matmul if torch.compiler.is_compiling() else _gguf_matmul
    col = 0
    for shard in shards:
        matmul(x, shard, part_compute(shard.type_name, compute), out, col)
        col += shard.shape[0]
    return out
