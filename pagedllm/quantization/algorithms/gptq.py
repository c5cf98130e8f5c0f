"""GPTQ (Frantar et al., 2022): quantize a linear layer's weight column by column, pushing each
column's rounding error onto the columns not yet quantized through the inverse Hessian of the
layer's reconstruction error, `H = 2 X^T X` over calibration inputs `X [tokens, in]`.

As AutoGPTQ / GPTQModel's `fasterquant` (static_groups off):
- dead inputs (`H[i, i] == 0`) get `H[i, i] = 1` and a zero weight column;
- act-order (`desc_act`): columns in descending `diag(H)` order; groups are formed in that
  order, and `g_idx` says each (checkpoint-order) column's group;
- dampening: `H += damp_percent * mean(diag(H)) * I`;
- `U = cholesky(H^-1)^T` (upper), then blocks of `block_size` columns: inside a block each
  column is rounded, its error `e = (w - q) / U[i, i]` updates the block's later columns
  (`W[:, i:] -= e U[i, i:]`), and once per block the rest of the matrix gets the block's errors
  (`W[:, i2:] -= E U[i1:i2, i2:]`);
- a group's scale / zero are chosen when its first column is reached, from the group's columns
  as they are then (error-updated). AutoGPTQ reads the group from the outer matrix, which does
  not yet hold the in-block updates of the current block; here the block's running copy is
  read, which is the matrix GPTQ's derivation means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.quantization.algorithms.grid import dequantize_codes, group_params, quantize_codes


@dataclass
class QuantizedWeight:
    """A quantized `W [out, in]`: codes int32 `[out, in]` (checkpoint column order), float16
    scales and int32 zeros `[out, groups]`, `g_idx` int32 `[in]` (each column's group)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return dequantize_codes(self.codes.float(), self.scales[:, g], self.zeros[:, g].float())


def hessian_order(H: torch.Tensor) -> torch.Tensor:
    """GPTQ's act-order: column indices by descending `diag(H)` (stable for ties)."""
    return torch.argsort(torch.diagonal(H), descending=True, stable=True)


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool = False,
                  damp_percent: float = 0.01, block_size: int = 128, min_zero: int = 0) -> QuantizedWeight:
    """GPTQ of `w [out, in]` given `H [in, in]` (2 X^T X / n of the layer's inputs)."""
    out, k = w.shape
    if H.shape != (k, k):
        raise ValueError(f"Hessian {tuple(H.shape)} does not match the weight's input size {k}")
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    if not 0 < damp_percent < 1:
        raise ValueError(f"damp_percent must be in (0, 1), got {damp_percent}")
    W = w.detach().to(torch.float32).clone()
    H = H.detach().to(torch.float32).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = hessian_order(H) if act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp_percent * torch.mean(torch.diagonal(H)))
    U = _upper_cholesky_of_inverse(H)

    codes = torch.zeros_like(W)
    n_groups = k // gs
    scales = torch.empty(out, n_groups, dtype=torch.float16)
    zeros = torch.empty(out, n_groups)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:  # entering a group: its grid from the columns as they are now
                g = col // gs
                cols = torch.cat([W1[:, i:i + gs], W[:, i2:col + gs]], dim=1) if col + gs > i2 else W1[:, i:i + gs]
                scales[:, g], zeros[:, g] = group_params(cols, bits, sym, min_zero)
                s, z = scales[:, g].float(), zeros[:, g]
            wcol = W1[:, i]
            q = quantize_codes(wcol, s, z, bits)
            codes[:, col] = q
            err = (wcol - dequantize_codes(q, s, z)) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]

    g_idx = torch.arange(k, dtype=torch.int32) // gs
    codes = codes.to(torch.int32)
    if perm is not None:  # back to the checkpoint's column order; g_idx follows the columns
        codes = torch.empty_like(codes).index_copy_(1, perm, codes)
        g_idx = torch.empty_like(g_idx).index_copy_(0, perm, g_idx)
    return QuantizedWeight(codes, scales, zeros.to(torch.int32), g_idx)


def _upper_cholesky_of_inverse(H: torch.Tensor) -> torch.Tensor:
    """`cholesky(H^-1)` as an upper triangle, in float64 for the small layers' sake; a matrix
    that is not positive definite after dampening gets more dampening (as GPTQModel retries)."""
    Hd = H.to(torch.float64)
    damp = 0.0
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).to(torch.float32)
        damp = max(damp * 10, 1e-6 * float(torch.diagonal(Hd).mean()))
        Hd = Hd + damp * torch.eye(Hd.shape[0], dtype=Hd.dtype)
    raise ValueError("the layer's Hessian is not positive definite even after extra dampening")


def accumulate_hessian(xtx: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Add `X^T X` of a batch `x [..., in]` to a running float64 sum (divide by the token count
    and multiply by 2 at the end: `H = 2 X^T X / n`)."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    part = (x2.t() @ x2).to(torch.float64)
    return part if xtx is None else xtx.add_(part)
