"""Hand-written CPU kernels (C, built on first use with the system compiler, called via ctypes).

- `paged_decode_attention.c`: decode attention reading K/V blocks in place (layers/backends/decode_op.py);
- `paged_prefill_attention.c`: prefill attention of all prefill sequences of a step in one call,
  K/V read in place (layers/backends/prefill_op.py);
- `packed_gemm.c`: `x @ W^T` against weights packed once into 32-column panels (layers/linear.py
  `linear`), every projection on CPU in float32;
- `int_gemm.c`: the same product against integer weights kept packed (GPTQ / AWQ /
  compressed-tensors / GGUF, and float weights that are exactly 4-bit / 8-bit blocks,
  pagedllm/quantization/formats/exact_block_encoding.py), exact float32 arithmetic or int8 activations with VNNI
  (quantization/int_kernel.py);
- `gguf_gemm.c`: the same product against llama.cpp's GGUF blocks read in place (every K-quant,
  legacy and IQ4 type; quantization/gguf_kernel.py);
- `fused_ops.c`: residual add + RMSNorm, SiLU-and-mul, rotary embedding in place, one call each
  (layers/norm.py, activation.py, rotary.py);
- `decode_step.c`: one decode step of a Llama-family decoder in one call, running the kernels
  above in the eager path's order (worker/cpu_decode_step.py);
- `lora.c`: the batched multi-LoRA shrink / expand, one call for a batch mixing adapters
  (lora/ops.py).

Each has a portable torch fallback; the loaders return None when a kernel cannot be built (no
compiler) or kernels are disabled with `PAGEDLLM_DISABLE_C_KERNELS=1`.
"""

from pagedllm.kernels.build import (
    decode_attention_kernel,
    decode_step_kernel,
    fused_ops_kernel,
    gguf_gemm_kernel,
    int_gemm_kernel,
    lora_kernel,
    packed_gemm_kernel,
    prefill_attention_kernel,
)

__all__ = ["decode_attention_kernel", "decode_step_kernel", "fused_ops_kernel", "gguf_gemm_kernel", "int_gemm_kernel", "lora_kernel", "packed_gemm_kernel", "prefill_attention_kernel"]
