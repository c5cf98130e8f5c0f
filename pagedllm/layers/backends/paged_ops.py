"""Tensor helpers of paged attention: write K/V into the paged cache, gather blocks back, masks."""

from __future__ import annotations

import torch


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `key/value [T, Hk, D]` at the flat slots `slot_mapping [T]` of the paged caches."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


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


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The blocks `block_table [..., n]` of `cache [num_blocks, block_size, Hk, D]`, flattened to
    `[..., n * block_size, Hk, D]` (one `index_select`: several times faster than `cache[table]`)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = torch.index_select(cache.view(num_blocks, -1), 0, block_table.reshape(-1))
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, num_kv_heads, head_dim)
