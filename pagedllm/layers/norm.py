"""RMSNorm with the same numerics as Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.fused import fused_kernel_for


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, the statistics taken in float32.

    The order of operations follows transformers' `LlamaRMSNorm` exactly (upcast, mean of squares,
    rsqrt, downcast, then scale), so that float32 outputs agree to the last bit or two. On CPU in
    float32 the residual add and the norm run as one C kernel (kernels/fused_ops.c).
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`; with `residual`, `(norm(x + residual), x + residual)`, the sum written into
        `residual` in place where the fused kernel runs (callers own that buffer)."""
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"RMSNorm: the input's hidden size {x.shape[-1]} != the weight's {self.weight.shape[0]}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"RMSNorm: residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
        kernel = fused_kernel_for(x, self.weight) if x.dim() == 2 else None
        if kernel is not None and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)):
            out = torch.empty_like(x)
            rows, hidden = x.shape
            kernel.add_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else 0,
                                self.weight.data_ptr(), out.data_ptr(), rows, hidden, self.variance_epsilon,
                                int(residual is not None), torch.get_num_threads())  # fmt: skip
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
