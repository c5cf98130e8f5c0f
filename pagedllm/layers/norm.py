"""RMSNorm with the same numerics as Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, the statistics taken in float32.

    The order of operations follows transformers' `LlamaRMSNorm` exactly (upcast, mean of squares,
    rsqrt, downcast, then scale), so that float32 outputs agree to the last bit or two.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
