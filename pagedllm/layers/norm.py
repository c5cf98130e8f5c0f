"""RMSNorm with the same numerics as Hugging Face's LlamaRMSNorm, and Gemma's `(1 + weight)` form."""

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
        weight = self.kernel_weight()
        kernel = fused_kernel_for(x, weight) if x.dim() == 2 else None
        if kernel is not None and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)):
            out = torch.empty_like(x)
            rows, hidden = x.shape
            kernel.add_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else 0,
                                weight.data_ptr(), out.data_ptr(), rows, hidden, self.variance_epsilon,
                                int(residual is not None), torch.get_num_threads())  # fmt: skip
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def kernel_weight(self) -> torch.Tensor:
        """The weight the fused kernel multiplies by, `weight * (x * rsqrt(...))`."""
        return self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x / sqrt(mean(x^2) + eps) * (1 + weight)`, all in float32, then cast.

    The checkpoint's weight is the offset from one (zeros mean identity). transformers'
    `Gemma2RMSNorm` / `Gemma3RMSNorm` multiply by `1 + weight` in float32 before the downcast,
    where Llama downcasts first and multiplies in the model's dtype: in bfloat16 the two differ,
    so this order is Gemma's own. In float32 on CPU the fused C kernel computes `(1 + w) * (x *
    r)`, the same product (the scale `1 + w` taken in float32 on each call: a vector of `hidden`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(hidden_size, eps, dtype, device)
        self.weight.data.zero_()  # identity until loaded, as transformers initialises it

    def kernel_weight(self) -> torch.Tensor:
        return 1.0 + self.weight.float()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)
