"""Tensor helpers of paged attention: write K/V into the paged cache, gather blocks back, masks,
soft-capped attention (which SDPA cannot do), and the soft-capping entry points of the C kernels."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from pagedllm.kernels.build import build_library
from pagedllm.layers.activation import soft_cap
from pagedllm.layers.kv_cache_dtype import KVHalf, gather_blocks, write_rows

__all__ = ["decode_mask", "gather_blocks", "prefill_mask", "softcap_attention", "softcap_kernel", "write_to_kv_cache"]


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: KVHalf,
    value_cache: KVHalf,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `key/value [T, Hk, D]` at the flat slots `slot_mapping [T]` of the paged caches
    (converted to the cache's element type, fp8 halves with their scales: layers/kv_cache_dtype.py)."""
    write_rows(key_cache, key, slot_mapping)
    write_rows(value_cache, value, slot_mapping)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # An additive 0 / -inf mask: on CPU, SDPA runs faster with it than with a boolean one.
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def decode_mask(
    context_lens: torch.Tensor, max_len: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask `[D, 1, 1, max_len]`: 0 where the key position is visible to the decode
    token (the last of its sequence), -inf elsewhere."""
    pos = torch.arange(max_len, device=context_lens.device)[None, :]
    ctx = context_lens[:, None]
    visible = pos < ctx
    if sliding_window is not None:
        visible &= pos >= ctx - sliding_window
    return _additive(visible[:, None, None, :], dtype)


def prefill_mask(
    query_len: int, context_len: int, sliding_window: int | None, dtype: torch.dtype, device: torch.device,
    explicit: bool = False, spans: Sequence[tuple[int, int]] = (),
) -> torch.Tensor | None:
    """Additive `[q, ctx]` bottom-right aligned causal mask; None when `is_causal` suffices
    (unless `explicit`: a caller without `is_causal`, soft-capped attention). `spans`: absolute
    (start, end) positions attended bidirectionally (Gemma 3's image blocks): a query inside
    one also sees every key of it; the sliding window applies after (transformers'
    AND(window, OR(causal, block)))."""
    if not explicit and not spans and query_len == context_len \
            and (sliding_window is None or sliding_window >= context_len):
        return None
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    visible = k_pos <= q_pos
    for start, end in spans:
        visible |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return _additive(visible, dtype)


def softcap_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping, in transformers' eager order (Gemma 2):
    `softmax(softcap * tanh(q k^T * scale / softcap) + mask) v`, the softmax in float32.
    `query [..., Hq, Lq, d]`, `key / value [..., Hk, Lk, d]` (Hq a multiple of Hk: head h reads
    KV head h // (Hq / Hk)), `mask` additive, broadcast to `[..., Hq, Lq, Lk]`."""
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = soft_cap(torch.matmul(query, key.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


def softcap_kernel(base: Callable[[], Callable | None], source: str, symbol: str) -> Callable[[], Callable | None]:
    """A loader of the C kernel `symbol` of `source`: the function `base()` binds (kernels/build.py)
    with one more trailing float argument, the soft cap (0: none). None where `base()` is."""

    @functools.cache
    def load() -> Callable | None:
        plain = base()
        library = build_library(source) if plain is not None else None
        if library is None:
            return None
        fn = getattr(library, symbol)
        fn.argtypes = [*plain.argtypes, ctypes.c_float]
        fn.restype = ctypes.c_int
        return fn

    return load
