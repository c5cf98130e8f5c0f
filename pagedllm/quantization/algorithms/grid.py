"""The integer grid: per group of `group_size` input columns and per output row, a float16
scale and an integer zero point, `W ~= (code - zero) * scale`, codes in `0 .. 2**bits - 1`.

Asymmetric: min/max of the group (the range always holds 0), `zero = round(-min / scale)`.
Symmetric: absmax, `scale = 2 * absmax / maxq`, `zero = 2**(bits-1)`, as AutoGPTQ's quantizer.
The scale is rounded to float16 (and kept >= 2**-14, no subnormals) before the codes are
chosen, so a written checkpoint dequantizes exactly to what the method optimised.
"""

from __future__ import annotations

import torch


def group_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float16, zero float32) of each row of `w [..., n]` (one group per row)."""
    w = w.to(torch.float32)
    maxq = (1 << bits) - 1
    if sym:
        scale = 2 * w.abs().amax(-1) / maxq
        zero = torch.full(scale.shape, float(1 << (bits - 1)), device=w.device)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(min_zero, maxq)
    return scale.clamp(min=2.0**-14).to(torch.float16), zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (float32 holding integers) of `w` on the grid `scale`, `zero` (broadcast to `w`)."""
    return (torch.round(w / scale.float()) + zero).clamp(0, (1 << bits) - 1)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - zero) * scale.float()


def _groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    return w.detach().to(torch.float32).reshape(out, k // gs, gs), gs


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0):
    """Round-to-nearest of `w [out, in]` in groups along the input: unsigned codes int32
    `[out, in]`, float16 scales `[out, groups]`, int32 zero points `[out, groups]`."""
    g, _ = _groups(w, group_size)
    scale, zero = group_params(g, bits, sym, min_zero)
    codes = quantize_codes(g, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)
    return codes.to(torch.int32).reshape(w.shape), scale, zero.to(torch.int32)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0) -> torch.Tensor:
    """`w` after round to nearest on its grid, float32, same shape (what the checkpoint holds)."""
    g, _ = _groups(w, group_size)
    scale, zero = group_params(g, bits, sym, min_zero)
    scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1)
    return dequantize_codes(quantize_codes(g, scale, zero, bits), scale, zero).reshape(w.shape)
