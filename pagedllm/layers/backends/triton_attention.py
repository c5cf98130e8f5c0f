"""Triton paged attention for the CUDA path: the KV-cache write, decode (flash-decoding) and
varlen prefill over the paged cache (`[num_blocks, block_size, kv_heads, head_dim]` per half,
layers/kv_cache_dtype.py), in float32 / bfloat16 / float16 or fp8 (e4m3fn, e5m2) with a
float32 scale per KV head.
CUDA-graph capture: no function here reads a device value on the host (no .item(), no
.tolist()); grids and every kernel constant come from shapes and host ints (`max_query_len`),
`num_splits` defaults to a function of `(seqs, kv_heads, block-table width, block size, SM
count)`; context lengths, block ids and slots are read by the kernels only, and the workspace
is allocated with torch.empty (the graph's pool during capture). Triton compiles a kernel on
its first launch for each specialization (dtypes, tiles, `num_splits == 1` or not, strides
divisible by 16): run every captured shape once before capturing, as graph runners do anyway.
The kernels and how they are jitted are in triton_attention_kernels.py, their tile sizes and
split counts in triton_attention_tiles.py, the argument checks in triton_attention_checks.py.
"""

from __future__ import annotations

import torch

from pagedllm.layers.backends.triton_attention_checks import (
    _FLOAT_DTYPES,
    _FP8_MAX,
    _LOG2E,
    _check_attention,
    _check_cache,
    _check_device,
    _need_triton,
    _scales,
    _softcap,
    _window,
)
from pagedllm.layers.backends.triton_attention_kernels import _Launch, _run
from pagedllm.layers.backends.triton_attention_tiles import (
    _capability,
    _decode_config,
    _dot_dtype,
    _next_pow2,
    _prefill_config,
    default_num_splits,
)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Store `key / value [T, Hk, D]` (any strides) at the flat slots `slot_mapping [T]`
    (`block * block_size + offset`; negative: skip the row) of `key_cache / value_cache [N, B,
    Hk, D]`: cast to a float cache, or `clamp(x / scale, -fmax, fmax)` rounded to an fp8 one."""
    _need_triton("write_kv_cache")
    name = "write_kv_cache"
    _check_cache(name, key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    want = (key.shape[0], num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != want or tuple(value.shape) != want:
        raise ValueError(f"{name}: key {tuple(key.shape)} and value {tuple(value.shape)} must be [T, {num_kv_heads}, "
                         f"{head_dim}] for the cache {tuple(key_cache.shape)}")
    if key.dtype not in _FLOAT_DTYPES or value.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: key / value must be float32, bfloat16 or float16, got {key.dtype} / {value.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"{name}: slot_mapping must be int32 / int64 [{key.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    _check_device(name, key, value, key_cache, value_cache, slot_mapping)
    fp8, ks, vs = _scales(name, key_cache.dtype, k_scale, v_scale, num_kv_heads, slot_mapping)
    if key.shape[0] == 0:
        return
    _run(_write_launch(key, value, key_cache, value_cache, slot_mapping, fp8, ks, vs))


def _write_launch(key, value, key_cache, value_cache, slot_mapping, fp8, ks, vs) -> _Launch:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    return _Launch("write", (key.shape[0],), (
        key, value, key_cache, value_cache, slot_mapping, ks, vs,
        num_kv_heads, *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
    ), dict(HEAD_DIM=head_dim, PAGE=block_size, BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim),
            FP8=fp8, FP8_MAX=_FP8_MAX.get(key_cache.dtype, 0.0)), dict(num_warps=4, num_stages=1))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """One query token per sequence, `query [S, Hq, D]`, over the first `context_lens[s]` (>= 1)
    cached positions of block-table row `s` -> `[S, Hq, D]` in query's dtype (or `out`).
    `num_splits`: programs per (sequence, KV head) over its keys (None: `default_num_splits`);
    the result does not depend on it beyond float32 rounding. `logits_soft_cap`: each scaled
    score s becomes `cap * tanh(s / cap)` (None: not). Capture-safe (module docstring)."""
    _need_triton("paged_decode_attention")
    name = "paged_decode_attention"
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    _check_attention(name, query, key_cache, value_cache, block_tables, context_lens, num_seqs, out)
    tensors = [query, key_cache, value_cache, block_tables, context_lens] + ([out] if out is not None else [])
    _check_device(name, *tensors)
    _softcap(name, logits_soft_cap)
    _, block_size, num_kv_heads, _ = key_cache.shape
    fp8, ks, vs = _scales(name, key_cache.dtype, k_scale, v_scale, num_kv_heads, context_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size, query.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{name}: num_splits must be a positive int, got {num_splits!r}")
    for launch in _decode_launches(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
                                   fp8, ks, vs, num_splits, out, logits_soft_cap):
        _run(launch)
    return out


def _decode_launches(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, fp8, ks, vs,
                     num_splits, out, logits_soft_cap: float | None = None) -> list[_Launch]:
    """The decode kernel's launch, and the reduce kernel's when split (workspace allocated here)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    has_window, window = _window(sliding_window)
    softcap, softcap_log2 = _softcap("paged_decode_attention", logits_soft_cap)
    cfg = _decode_config(head_dim, group, query.dtype)
    split = num_splits > 1
    if split:
        ws_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    else:
        ws_m = ws_l = ws_acc = out
    launches = [_Launch("decode", (num_seqs, num_kv_heads, num_splits), (
        query, key_cache, value_cache, block_tables, context_lens, ks, vs, out, ws_m, ws_l, ws_acc,
        scale * _LOG2E, window, num_splits, softcap_log2,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
    ), dict(G=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"],
            BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=has_window, FP8=fp8, SPLIT=split, DOT_DTYPE=_dot_dtype(query.dtype),
            SOFTCAP=softcap),
        dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))]
    if split:
        launches.append(_Launch("reduce", (num_seqs, num_heads), (ws_m, ws_l, ws_acc, out, num_splits, *out.stride()),
                                dict(HEAD_DIM=head_dim, BLOCK_SPLITS=_next_pow2(num_splits), BLOCK_D=cfg["BLOCK_D"]),
                                dict(num_warps=4, num_stages=1)))
    return launches


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_query_len: int, sliding_window: int | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Varlen prefill over the cache: `query [T, Hq, D]` holds P sequences' new tokens back to
    back (`query_start_loc [P + 1]`), whose K/V are already in the cache; sequence p has
    `context_lens[p]` positions (cached + new) in block-table row p, and its query i sits at
    `ctx - qlen + i` (bottom-right causal, minus the window). `max_query_len` (host int, >= every
    qlen) sizes the grid. `logits_soft_cap`: the scores capped as in decode (None: not). Returns
    `[T, Hq, D]` in query's dtype (or writes `out`)."""
    _need_triton("paged_prefill_attention")
    name = "paged_prefill_attention"
    num_prefills = context_lens.shape[0] if context_lens.dim() == 1 else -1
    _check_attention(name, query, key_cache, value_cache, block_tables, context_lens, num_prefills, out)
    if tuple(query_start_loc.shape) != (num_prefills + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: query_start_loc must be int32 / int64 [{num_prefills + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{name}: max_query_len must be a host int >= 0, got {max_query_len!r}")
    tensors = [query, key_cache, value_cache, block_tables, query_start_loc, context_lens]
    _check_device(name, *tensors, *([out] if out is not None else []))
    _softcap(name, logits_soft_cap)
    num_kv_heads = key_cache.shape[2]
    fp8, ks, vs = _scales(name, key_cache.dtype, k_scale, v_scale, num_kv_heads, context_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_prefills == 0 or query.shape[0] == 0 or max_query_len == 0:
        return out
    _run(_prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                         max_query_len, sliding_window, fp8, ks, vs, out, logits_soft_cap=logits_soft_cap))
    return out


def _prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len,
                    sliding_window, fp8, ks, vs, out, capability: tuple[int, int] | None = None,
                    logits_soft_cap: float | None = None) -> _Launch:
    """The prefill kernel's launch; `capability` (default: the device's) picks the tiles."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    has_window, window = _window(sliding_window)
    softcap, softcap_log2 = _softcap("paged_prefill_attention", logits_soft_cap)
    cfg = _prefill_config(max_query_len, head_dim, group, query.dtype, capability or _capability(query.device))
    grid = (-(-max_query_len // cfg["BLOCK_Q"]), context_lens.shape[0], num_kv_heads)
    return _Launch("prefill", grid, (
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, ks, vs, out,
        scale * _LOG2E, window, softcap_log2,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
    ), dict(G=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"],
            BLOCK_D=cfg["BLOCK_D"], BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=has_window, FP8=fp8,
            DOT_DTYPE=_dot_dtype(query.dtype), SOFTCAP=softcap), dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
