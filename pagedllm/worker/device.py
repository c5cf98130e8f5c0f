"""Pick the device and compute dtype from the user's "auto" choices."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """"auto" takes CUDA when present, else the CPU; asking for CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, bf16_supported: bool | None = None) -> torch.dtype:
    """"auto" is float32 on CPU (exact parity, fast kernels there) and bfloat16 on a GPU, float16
    on one without bfloat16 (before Ampere), as vLLM chooses; bfloat16 asked of such a GPU is an
    error. `bf16_supported`: the GPU's answer (None: asked of torch)."""
    if device.type == "cuda" and dtype in ("auto", "bfloat16"):
        if bf16_supported is None:
            bf16_supported = torch.cuda.is_bf16_supported()
        if not bf16_supported:
            if dtype == "bfloat16":
                raise ValueError("dtype='bfloat16' is not supported by this GPU (compute capability below 8.0); "
                                 "use dtype='float16'.")
            return torch.float16
        return torch.bfloat16
    if dtype == "auto":
        return torch.float32
    return _DTYPES[dtype]
