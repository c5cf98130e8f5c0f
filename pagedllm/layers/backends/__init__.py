"""Attention backends: how a layer reads and writes the paged KV cache.

`torch_paged` is the portable implementation (plain torch ops and, on CPU, the C kernels);
`triton_paged` is the CUDA one (Triton kernels, capture-safe for CUDA graphs). Layers are built
with the torch backend; the worker sets the chosen one on every attention layer once the model
is loaded (`select_attn_backend`, then layers/attention.py's `set_attn_backend`), so the choice
is one per model.
"""

from __future__ import annotations

import logging

import torch

from pagedllm import envs
from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend

logger = logging.getLogger(__name__)


def get_attn_backend() -> type:
    """The backend a layer is built with (replaced by `set_attn_backend`)."""
    return TorchPagedAttentionBackend


def _triton_installed() -> bool:
    from pagedllm.layers.backends import triton_attention_kernels  # lazy: imports triton (optional, slow)

    return triton_attention_kernels.HAS_TRITON


FP8_MIN_CAPABILITY = (8, 9)  # Ada, Hopper: Triton's fp8 conversions need sm_89+


def select_attn_backend(name: str, device: torch.device, kv_cache_dtype: torch.dtype,
                        capability: tuple[int, int] | None = None) -> type:
    """The backend for `attention_backend=name` on `device` with this cache type; a choice that
    cannot run is a ValueError that says why. `capability`: the GPU's compute capability (None:
    asked of torch, only for an fp8 cache)."""
    if name == "torch":
        return TorchPagedAttentionBackend
    if name not in ("auto", "triton"):
        raise ValueError(f"attention_backend must be one of ['auto', 'torch', 'triton'], got {name!r}.")
    # lazy: the Triton backend imports triton (optional, slow), never needed for name="torch"
    from pagedllm.layers.backends.triton_paged import SUPPORTED_CACHE_DTYPES, TritonPagedAttentionBackend

    if name == "auto":
        if device.type != "cuda":
            return TorchPagedAttentionBackend
        if kv_cache_dtype not in SUPPORTED_CACHE_DTYPES:
            logger.info("kv_cache_dtype %s: the torch attention backend (the Triton kernels read float and "
                        "fp8 caches); decode steps run eager", kv_cache_dtype)
            return TorchPagedAttentionBackend
        if not _triton_installed():
            logger.warning("triton is not installed: attention runs in the torch backend, without CUDA "
                           "graphs (pip install triton for the fast path)")
            return TorchPagedAttentionBackend
        if _fp8_unsupported(device, kv_cache_dtype, capability):
            logger.warning("kv_cache_dtype %s on a GPU below compute capability 8.9: the torch backend "
                           "converts it (slower, no CUDA graphs)", kv_cache_dtype)
            return TorchPagedAttentionBackend
        return TritonPagedAttentionBackend
    if not _triton_installed():
        raise ValueError("attention_backend='triton' needs the triton package (pip install triton).")
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(f"attention_backend='triton' needs a CUDA device, not {device.type!r} "
                         "(or TRITON_INTERPRET=1, which runs the kernels slowly in Triton's interpreter: tests).")
    if kv_cache_dtype not in SUPPORTED_CACHE_DTYPES:
        raise ValueError(f"attention_backend='triton' does not read kv_cache_dtype {kv_cache_dtype}; "
                         "use a float or fp8 cache, or attention_backend='torch'.")
    if _fp8_unsupported(device, kv_cache_dtype, capability):
        raise ValueError(f"attention_backend='triton' with kv_cache_dtype {kv_cache_dtype} needs a GPU of compute "
                         f"capability 8.9 or more (Ada, Hopper); this one is {_capability(device, capability)}. "
                         "Use attention_backend='torch' or a bfloat16 / float16 cache.")
    return TritonPagedAttentionBackend


def _capability(device: torch.device, capability: tuple[int, int] | None) -> tuple[int, int]:
    return capability if capability is not None else torch.cuda.get_device_capability(device)


def _fp8_unsupported(device: torch.device, kv_cache_dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    from pagedllm.layers.backends.triton_paged import FP8_DTYPES  # lazy: imports triton (optional, slow)

    return (device.type == "cuda" and kv_cache_dtype in FP8_DTYPES
            and tuple(_capability(device, capability)) < FP8_MIN_CAPABILITY)


__all__ = ["TorchPagedAttentionBackend", "get_attn_backend", "select_attn_backend"]
