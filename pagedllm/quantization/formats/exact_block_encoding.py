"""Find an exact compact encoding of a float32 weight: blocks of 32 along each row as
`d * q + m` with 4-bit q (Q4A) or `d * q` with 8-bit q (Q8S), d and m float16 values.

Why: a GGUF model's weights were quantized (Q4_1, Q8_0) before we dequantized them to float32,
so they still lie exactly on such grids; kernels/int_gemm.c's exact path can then read 0.75 or
1.2 bytes per weight instead of 4 in the memory-bound decode products and still multiply by
exactly the same float32 values (layers/linear.prepare_weight packs the encoding for it). The encoding is recovered from the float32 values themselves and accepted
only if every block reproduces bit for bit (d * q is exact in float32 for a float16 d, and
`d * q + m` rounds once, as GGUF's dequantization does), so it is never an approximation and
needs nothing from the loader. Weights that are not on such a grid (a safetensors float model)
are simply not encoded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32
FORMAT_Q4A = 0  # d * q + m, q 0..15
FORMAT_Q8S = 1  # d * q, q int8
_MAX_FIRST_TRY_MISSES = 0.01  # give up on a format when more blocks than this miss at first


class BlockEncoding(NamedTuple):
    format: int
    codes: torch.Tensor  # uint8 [N, K]: 0..15 (Q4A) or int8 bits (Q8S)
    scales: torch.Tensor  # float32 [N, K / 32]
    offsets: torch.Tensor  # float32 [N, K / 32] (zeros for Q8S)


def _fp16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.half().float() == t


def _fp16_neighbours(d: torch.Tensor) -> list[torch.Tensor]:
    """d rounded to float16, then the float16 values one and two steps either side."""
    bits = d.half().view(torch.int16)
    return [(bits + s).view(torch.float16).float() for s in (0, 1, -1, 2, -2)]


def _try_scales(blocks: torch.Tensor, candidates: list[torch.Tensor], offsets: torch.Tensor, lo: int, hi: int):
    """Codes and scales that reproduce each block, trying the candidate scales in turn."""
    codes = torch.zeros(blocks.shape, dtype=torch.int16)
    scales = torch.zeros(blocks.shape[:-1])
    done = torch.zeros(blocks.shape[:-1], dtype=torch.bool)
    for attempt, d in enumerate(candidates):
        todo = ~done
        if not todo.any():
            break
        b, dd, mm = blocks[todo], d[todo].unsqueeze(-1), offsets[todo].unsqueeze(-1)
        safe = torch.where(dd == 0, torch.ones_like(dd), dd)
        q = torch.round((b - mm) / safe).clamp(lo, hi)
        q = torch.where(dd == 0, torch.zeros_like(q), q)
        ok = (q * dd + mm == b).all(-1) & torch.isfinite(dd.squeeze(-1))
        if attempt == 0 and (~ok).float().mean().item() > _MAX_FIRST_TRY_MISSES:
            return None
        idx = todo.nonzero(as_tuple=True)
        sel = tuple(i[ok] for i in idx)
        codes[sel] = q[ok].to(torch.int16)
        scales[sel] = dd.squeeze(-1)[ok]
        done[sel] = True
    return (codes, scales) if bool(done.all()) else None


@torch.no_grad()
def find_block_encoding(weight: torch.Tensor) -> BlockEncoding | None:
    """The exact Q4A or Q8S encoding of a 2-D float32 CPU weight, or None if it has none."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK != 0 or weight.numel() == 0:
        return None
    n, k = weight.shape
    blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
    if not bool(torch.isfinite(blocks).all()):
        return None
    lo_vals, hi_vals = blocks.amin(-1), blocks.amax(-1)
    if bool(_fp16_exact(lo_vals).all()):
        found = _try_scales(blocks, _fp16_neighbours((hi_vals - lo_vals) / 15), lo_vals, 0, 15)
        if found is not None:
            codes, scales = found
            return BlockEncoding(FORMAT_Q4A, codes.to(torch.uint8).reshape(n, k), scales, lo_vals.contiguous())
    amax = blocks.abs().amax(-1)
    zeros = torch.zeros_like(amax)
    found = _try_scales(blocks, _fp16_neighbours(amax / 127), zeros, -127, 127)
    if found is not None:
        codes, scales = found
        if bool(_fp16_exact(scales).all()):
            return BlockEncoding(FORMAT_Q8S, codes.to(torch.int8).view(torch.uint8).reshape(n, k), scales, zeros)
    return None
