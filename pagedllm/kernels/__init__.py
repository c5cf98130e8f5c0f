"""Hand-written CPU kernels (C, built on first use with the system compiler, called via ctypes).

- `paged_decode_attention.c`: decode attention reading K/V blocks in place (layers/backends/decode_op.py);
- `small_gemm.c`: `x @ W^T` for decode-sized batches (layers/linear.py `linear`).

Each has a portable torch fallback; the loaders return None when a kernel cannot be built (no
compiler) or kernels are disabled with `PAGEDLLM_DISABLE_C_KERNELS=1`.
"""

from pagedllm.kernels.build import decode_attention_kernel, small_gemm_kernel

__all__ = ["decode_attention_kernel", "small_gemm_kernel"]
