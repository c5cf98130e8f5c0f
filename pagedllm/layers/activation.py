"""Gated activations for fused gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.fused import fused_kernel_for


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the input is the fused projection `[..., gate | up]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul: the fused [gate | up] width must be even, got {x.shape[-1]}")
        d = x.shape[-1] // 2
        kernel = fused_kernel_for(x) if x.dim() == 2 else None
        if kernel is not None:
            out = torch.empty(x.shape[0], d, dtype=x.dtype)
            kernel.silu_mul(x.data_ptr(), out.data_ptr(), x.shape[0], d, torch.get_num_threads())
            return out
        return F.silu(x[..., :d]) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation module for a HF `hidden_act` name (only SiLU for the Llama family)."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    raise ValueError(f"Unsupported activation {hidden_act!r}; supported: ['silu']")
