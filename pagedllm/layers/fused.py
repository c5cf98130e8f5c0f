"""When the fused C kernels of kernels/fused_ops.c apply: float32, contiguous, on CPU, eager.

Under torch.compile (the opt-in decode graphs) and on other devices or dtypes the layers use
their plain torch expressions instead, which inductor fuses itself.
"""

from __future__ import annotations

import torch

from pagedllm.kernels import fused_ops_kernel

_kernel = fused_ops_kernel


def fused_kernel_for(*tensors: torch.Tensor):
    """The fused-ops kernels if they apply to all of `tensors`, else None."""
    if torch.compiler.is_compiling():
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return None
    return _kernel()
