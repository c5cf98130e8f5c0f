"""Bit packing of integer codes into int32 words, and the dequantization every weight-only
integer format shares once it is in the canonical form.

Sequential packing (GPTQ, compressed-tensors): along the packed dimension, element `pf * w + i`
lies in word `w` at bits `[bits * i, bits * (i + 1))`, `pf = 32 // bits`.
AWQ ("gemm", AutoAWQ): packed along the output dimension, 8 nibbles a word, but word `w`'s
nibble `i` holds column `8 * w + AWQ_ORDER[i]`.

Canonical form (what every linear method in this package leaves on its layer after loading,
and what `dequantize` reads): `qweight` int32 `[in / pf, out]` of unsigned codes packed along
the input dimension, `scales` `[groups, out]` (the checkpoint's float dtype), `zeros` uint8
`[groups, out]` (true zero points, unsigned domain), groups of `group_size` consecutive input
rows, and `perm` int64 `[in]` or None (act-order: input row `r` of the canonical weight is row
`perm[r]` of the checkpoint's, so the forward reads `x[:, perm]`). The weight is then
`W[r, c] = (code[r, c] - zeros[r // group_size, c]) * scales[r // group_size, c]`, exact in
float32 (a small integer times a float16 / bfloat16 value).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j is nibble AWQ_REVERSE_ORDER[j]


def pack_factor(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits} cannot be packed into int32 words here (2, 4 or 8)")
    return 32 // bits


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned codes (0 .. 2**bits - 1) sequentially along `dim` into int32 words."""
    pf = pack_factor(bits)
    if codes.shape[dim] % pf:
        raise ValueError(f"cannot pack {codes.shape[dim]} codes along dim {dim} into words of {pf}")
    c = codes.movedim(dim, -1).to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(f"codes outside 0..{(1 << bits) - 1} cannot be packed in {bits} bits")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // pf, pf)
    shifts = torch.arange(pf, dtype=torch.int64, device=c.device) * bits
    words = (c << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The int32 codes of `pack_int32`'s words (the packed dim grows by 32 // bits)."""
    pf = pack_factor(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    p = packed.movedim(dim, -1)
    shifts = torch.arange(pf, dtype=torch.int32, device=p.device) * bits
    codes = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*p.shape[:-1], p.shape[-1] * pf).movedim(-1, dim).contiguous()


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's gemm packing of 4-bit codes `[rows, cols]` -> int32 `[rows, cols / 8]`."""
    rows, cols = codes.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 columns a word; {cols} columns do not divide")
    ordered = codes.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, cols)
    return pack_int32(ordered, 4, dim=1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes `[rows, cols]` of AutoAWQ's int32 `[rows, cols / 8]`."""
    seq = unpack_int32(packed, 4, dim=1)
    rows, cols = seq.shape
    return seq.reshape(rows, cols // 8, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(rows, cols).contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """The float32 weight `[in, out]` of a canonical-form layer (see the module's docstring)."""
    pf = 32 // bits
    rows, out = qweight.shape[0] * pf, qweight.shape[1]
    shifts = torch.arange(pf, dtype=torch.int32, device=qweight.device).mul_(bits).view(1, pf, 1)
    codes = ((qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).view(rows // group_size, group_size, out)
    w = (codes - zeros.unsqueeze(1).to(torch.int32)).to(torch.float32)
    return w.mul_(scales.unsqueeze(1).to(torch.float32)).view(rows, out)
