"""Paged attention in plain torch (the portable backend, used on CPU).

Decode: all decode sequences of the step in one batched computation per layer. Their block tables
(padded with block 0 to the longest sequence *in this batch*) gather the used blocks only into
`[D, max_blocks * block_size, Hk, D]`; key positions at or past a sequence's context length are
masked (an additive 0 / -inf mask). Grouped-query attention folds the query heads that share a KV head into the query-length
axis (`[D, Hk, group, D]`), so the KV heads are never repeated.

Prefill: per sequence. A plain prefill (no cached context) attends over its own fresh K/V with a
causal mask; a chunk on top of cached context (chunked prefill, prefix-cache hit) gathers its
context from the cache and uses a bottom-right aligned causal mask: query `i` sits at absolute
position `ctx_len - q_len + i` and sees keys `0 ..` that position.

Sliding-window layers additionally hide keys at positions `<= query_pos - window` (the
transformers convention `kv_idx > q_idx - window`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pagedllm.layers.attention import AttentionMetadata


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


class TorchPagedAttentionBackend:
    name = "torch_paged"

    @staticmethod
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """`query [T, Hq, D]`, `key/value [T, Hk, D]` -> attention output `[T, Hq, D]`."""
        md = attn_metadata
        write_to_kv_cache(key, value, key_cache, value_cache, md.slot_mapping)
        out = torch.empty_like(query)
        num_decode = md.num_decode_tokens
        if num_decode > 0:
            out[:num_decode] = _decode(query[:num_decode], key_cache, value_cache, md, scale, sliding_window)
        for i in range(md.num_prefills):
            start, q_len = md.prefill_query_starts[i], md.prefill_query_lens[i]
            end = start + q_len
            out[start:end] = _prefill_one(
                i, query[start:end], key[start:end], value[start:end], key_cache, value_cache, md, scale, sliding_window
            )
        return out


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[-2]
    group = num_heads // num_kv_heads
    block_tables = md.decode_block_tables
    max_len = block_tables.shape[1] * md.block_size
    mask = md.cached_mask(
        ("decode", sliding_window),
        lambda: decode_mask(md.decode_context_lens, max_len, sliding_window, query.dtype),
    )
    k = gather_blocks(key_cache, block_tables).transpose(1, 2)  # [D, Hk, L, dh]
    v = gather_blocks(value_cache, block_tables).transpose(1, 2)
    q = query.view(num_seqs, num_kv_heads, group, head_dim)  # query heads grouped by their KV head
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [D, Hk, group, dh]
    return o.reshape(num_seqs, num_heads, head_dim)


def _prefill_one(
    i: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    q_len, ctx_len = md.prefill_query_lens[i], md.prefill_context_lens[i]
    mask = md.cached_mask(
        ("prefill", i, sliding_window),
        lambda: prefill_mask(q_len, ctx_len, sliding_window, query.dtype, query.device),
    )
    if ctx_len == q_len:
        k, v = key, value  # no cached context: the fresh K/V are the whole context
    else:
        block_table = md.prefill_block_tables[i]
        k = gather_blocks(key_cache, block_table)[:ctx_len]
        v = gather_blocks(value_cache, block_table)[:ctx_len]
    o = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, Hq, q, dh]
        k.transpose(0, 1).unsqueeze(0),  # [1, Hk, ctx, dh]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)  # [q, Hq, dh]
