"""Argument checks of the Triton attention wrappers: shapes, dtypes, devices, fp8 scales, the
window and the soft cap, each refused with a ValueError that names the argument.

Apart from the wrappers so that they read as what they launch; every check runs on the host
from shapes and dtypes only (no device value is read: capture-safe).
"""

from __future__ import annotations

import math

import torch

from pagedllm import envs
from pagedllm.layers.backends.triton_attention_kernels import HAS_TRITON
from pagedllm.layers.backends.triton_attention_tiles import _capability

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_CACHE_DTYPES = (*_FLOAT_DTYPES, *_FP8_MAX)
_LOG2E = 1.4426950408889634


def _need_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs the triton package (pip install triton); it is not installed, and "
                           "CPU inference does not use it")


def _check_device(name: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(f"{name}: tensors on {device} need TRITON_INTERPRET=1 (Triton's CPU interpreter); the "
                         "compiled kernels run on CUDA tensors")


def _check_cache(name: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"{name}: key_cache and value_cache must both be [num_blocks, block_size, kv_heads, "
                         f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype not in _CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"{name}: cache dtype must be one of {list(_CACHE_DTYPES)} (both halves alike), got "
                         f"{key_cache.dtype} / {value_cache.dtype}")


def _scales(name: str, cache_dtype: torch.dtype, k_scale, v_scale, num_kv_heads: int, like: torch.Tensor):
    """(fp8?, k_scale, v_scale) as kernel arguments: fp8 caches need float32 [Hk] scales; float
    caches hold their values themselves (scales, if passed, are not used)."""
    if cache_dtype not in _FP8_MAX:
        return False, like, like
    if cache_dtype == torch.float8_e4m3fn and _capability(like.device) < (8, 9):
        raise ValueError(f"{name}: a float8_e4m3fn KV cache needs a GPU of compute capability >= 8.9 (Triton "
                         f"has no e4m3fn type before Ada / Hopper), this one is "
                         f"{'.'.join(map(str, _capability(like.device)))}; use float8_e5m2")
    for what, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or tuple(sc.shape) != (num_kv_heads,):
            raise ValueError(f"{name}: a {cache_dtype} cache needs {what} as a float32 tensor [{num_kv_heads}] "
                             f"(one scale per KV head), got {getattr(sc, 'dtype', type(sc).__name__)} "
                             f"{tuple(getattr(sc, 'shape', ()))}")
    return True, k_scale.contiguous(), v_scale.contiguous()


def _check_attention(name: str, query, key_cache, value_cache, block_tables, context_lens, num_rows, out):
    _check_cache(name, key_cache, value_cache)
    if query.dim() != 3 or query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: query must be a float32 / bfloat16 / float16 tensor [tokens, heads, head_dim], "
                         f"got {query.dtype} {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"{name}: query head_dim {head_dim} != the cache's head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: {num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_rows or block_tables.dtype not in (torch.int32,
                                                                                                  torch.int64):
        raise ValueError(f"{name}: block_tables must be int32 / int64 [{num_rows}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (num_rows,) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: context_lens must be int32 / int64 [{num_rows}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if out is not None and (tuple(out.shape) != tuple(query.shape) or out.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"{name}: out must be a float tensor of the query's shape {tuple(query.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")


def _window(sliding_window: int | None) -> tuple[bool, int]:
    if sliding_window is None or sliding_window <= 0:
        return False, 0
    return True, int(sliding_window)


def _softcap(name: str, logits_soft_cap: float | None) -> tuple[bool, float]:
    """(SOFTCAP, cap * log2 e) for the kernels; None or 0: no capping. ValueError unless the cap
    is a positive finite number."""
    if not logits_soft_cap:
        return False, 0.0
    if not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
        raise ValueError(f"{name}: logits_soft_cap must be a positive finite number (or None), got {logits_soft_cap!r}")
    return True, float(logits_soft_cap) * _LOG2E
