"""Gated activations for fused gate/up projections: SiLU (Llama family), GELU-tanh (Gemma)."""

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


class GeluTanhAndMul(nn.Module):
    """`gelu_tanh(gate) * up` of the fused `[..., gate | up]`: transformers' `gelu_pytorch_tanh`
    (`F.gelu(x, approximate="tanh")`, Gemma's `hidden_activation`), in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"GeluTanhAndMul: the fused [gate | up] width must be even, got {x.shape[-1]}")
        d = x.shape[-1] // 2
        kernel = fused_kernel_for(x) if x.dim() == 2 else None
        if kernel is not None:  # one pass in C, the op the C decode step runs too
            out = torch.empty(x.shape[0], d, dtype=x.dtype)
            kernel.gelu_tanh_mul(x.data_ptr(), out.data_ptr(), x.shape[0], d, torch.get_num_threads())
            return out
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)`, in transformers' order: Gemma's soft-capping of attention scores
    and of the final logits (a smooth clamp to (-cap, cap))."""
    return torch.tanh(x / cap) * cap


_GATED = {"silu": SiluAndMul, "swish": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation module for a HF `hidden_act` / `hidden_activation` name."""
    if hidden_act in _GATED:
        return _GATED[hidden_act]()
    raise ValueError(f"Unsupported activation {hidden_act!r}; supported: {sorted(_GATED)}")
