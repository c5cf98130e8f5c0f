"""Paged attention in plain torch (the portable backend, used on CPU).

Decode: all decode sequences of the step in one call of the `pagedllm::paged_decode_attention`
operator (layers/backends/decode_op.py), which writes their K/V and attends over the blocks in
place (a C kernel on CPU float32; a gather + SDPA torch path elsewhere).

The cache's element type (float32, bfloat16, float16, int8, fp8 with the layer's per-KV-head
`k_scale` / `v_scale`: layers/kv_cache_dtype.py) is read and written by both paths (the C
kernels decline float16 and fp8, which then take the torch path); every query attends to the
cache's values, never to fresher ones, so that a prompt computed whole or in chunks sees the
same numbers.

Prefill: on CPU float32 all prefill sequences in one call of the C kernel
(layers/backends/prefill_op.py), which writes their K/V and reads the context in place from the
blocks. Otherwise (the portable path) per sequence: a plain prefill (no cached context) attends over its own fresh K/V with a
causal mask; a chunk on top of cached context (chunked prefill, prefix-cache hit) gathers its
context from the cache and uses a bottom-right aligned causal mask: query `i` sits at absolute
position `ctx_len - q_len + i` and sees keys `0 ..` that position.

A step whose metadata carries bidirectional spans (Gemma 3's image blocks at prefill,
`AttentionMetadata.prefill_bidirectional_spans`) takes the per-sequence path with an explicit
mask for all its prefills (text-only steps never do: no cost to them).

Sliding-window layers additionally hide keys at positions `<= query_pos - window` (the
transformers convention `kv_idx > q_idx - window`).

Logit soft-capping (`logits_soft_cap`, Gemma 2: `cap * tanh(score / cap)` after the scale, before
the mask) runs in both C kernels; the portable path, where SDPA cannot cap, computes such a
layer's attention with explicit matmuls in transformers' eager order (`paged_ops.softcap_attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.layers.backends.decode_op import paged_decode_attention_eager
from pagedllm.layers.backends.paged_ops import gather_blocks, prefill_mask, softcap_attention, write_to_kv_cache
from pagedllm.layers.backends.prefill_op import prefill_attention_c
from pagedllm.layers.kv_cache_dtype import KVHalf, split_kv_cache

if TYPE_CHECKING:
    from pagedllm.layers.attention import AttentionMetadata


class TorchPagedAttentionBackend:
    name = "torch_paged"

    @staticmethod
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """`query [T, Hq, D]`, `key/value [T, Hk, D]`, `kv_cache [2, blocks, block_size, Hk, D]`
        -> attention output `[T, Hq, D]`. `k_scale` / `v_scale` (float32 [Hk]): the layer's fp8
        scales, required with an fp8 cache, ignored with any other. `logits_soft_cap`: the
        scores' soft cap (None or 0: none)."""
        md = attn_metadata
        cap = float(logits_soft_cap or 0.0)
        nd = md.num_decode_tokens
        decoded = None
        if nd > 0:
            # Under torch.compile the registered op (one opaque graph node); eager, the same
            # function called directly, without the dispatcher's overhead (~35 us a layer).
            op = torch.ops.pagedllm.paged_decode_attention if torch.compiler.is_compiling() else paged_decode_attention_eager
            decoded = op(
                query[:nd], key[:nd], value[:nd], kv_cache, md.slot_mapping[:nd],
                md.decode_block_tables, md.decode_context_lens, scale, sliding_window, k_scale, v_scale, cap,
            )  # fmt: skip
            if md.num_prefills == 0:
                return decoded
        key_cache, value_cache = split_kv_cache(kv_cache, key.shape[1], key.shape[2], k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if decoded is not None:
            out[:nd] = decoded
        if not torch.compiler.is_compiling() and not md.prefill_bidirectional_spans:
            done = prefill_attention_c(
                query[nd:], key[nd:], value[nd:], key_cache, value_cache, md, scale, sliding_window, out=out[nd:],
                logits_soft_cap=cap,
            )  # fmt: skip
            if done is not None:
                return out
        write_to_kv_cache(key[nd:], value[nd:], key_cache, value_cache, md.slot_mapping[nd:])
        for i in range(md.num_prefills):
            start, q_len = md.prefill_query_starts[i], md.prefill_query_lens[i]
            end = start + q_len
            out[start:end] = _prefill_one(
                i, query[start:end], key[start:end], value[start:end], key_cache, value_cache, md, scale, sliding_window,
                cap,
            )
        return out


def redo_bidirectional_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    softcap: float,
    out: torch.Tensor,
) -> None:
    """Recompute into `out` the prefill sequences with bidirectional spans (their K/V already in
    the cache): a backend whose kernel masks causally only (Triton) calls this after it."""
    key_cache, value_cache = split_kv_cache(kv_cache, key.shape[1], key.shape[2], k_scale, v_scale)
    for i, spans in enumerate(md.prefill_bidirectional_spans):
        if spans:
            start, end = md.prefill_query_starts[i], md.prefill_query_starts[i] + md.prefill_query_lens[i]
            out[start:end] = _prefill_one(i, query[start:end], key[start:end], value[start:end], key_cache,
                                          value_cache, md, scale, sliding_window, softcap)


def _prefill_one(
    i: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: KVHalf,
    value_cache: KVHalf,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float = 0.0,
) -> torch.Tensor:
    q_len, ctx_len = md.prefill_query_lens[i], md.prefill_context_lens[i]
    explicit = softcap > 0  # soft-capped attention has no `is_causal`
    spans = md.prefill_bidirectional_spans[i] if md.prefill_bidirectional_spans else ()
    mask = md.cached_mask(
        ("prefill", i, sliding_window, explicit),
        lambda: prefill_mask(q_len, ctx_len, sliding_window, query.dtype, query.device, explicit, spans),
    )
    if ctx_len == q_len and key_cache.dtype == key.dtype:
        k, v = key, value  # no cached context, an exact cache: the fresh K/V are the context
    else:  # the cache's values (converted / dequantized), as the C kernel and decode read them
        block_table = md.prefill_block_tables[i]
        k = gather_blocks(key_cache, block_table, query.dtype)[:ctx_len]
        v = gather_blocks(value_cache, block_table, query.dtype)[:ctx_len]
    q4 = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, q, dh]
    k4 = k.transpose(0, 1).unsqueeze(0)  # [1, Hk, ctx, dh]
    v4 = v.transpose(0, 1).unsqueeze(0)
    if explicit:
        o = softcap_attention(q4, k4, v4, mask, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)  # [q, Hq, dh]
