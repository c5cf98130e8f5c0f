"""Tensor helpers of paged attention: write K/V into the paged cache, gather blocks back, masks."""

from __future__ import annotations

import torch

from pagedllm.layers.kv_cache_format import KVHalf, gather_blocks, write_rows

__all__ = ["decode_mask", "gather_blocks", "prefill_mask", "write_to_kv_cache"]


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: KVHalf,
    value_cache: KVHalf,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `key/value [T, Hk, D]` at the flat slots `slot_mapping [T]` of the paged caches
    (converted to the cache's element type, fp8 halves with their scales: layers/kv_cache_format.py)."""
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
    query_len: int, context_len: int, sliding_window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Additive `[q, ctx]` bottom-right aligned causal mask; None when `is_causal` suffices."""
    if query_len == context_len and (sliding_window is None or sliding_window >= context_len):
        return None
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return _additive(visible, dtype)
