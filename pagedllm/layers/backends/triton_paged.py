"""Paged attention in Triton kernels (the CUDA backend, `attention_backend="triton"`).

One forward = one write kernel for all the step's new K/V (by slot mapping), then one decode
kernel for the decode rows (split-K over the context for long sequences) and one varlen prefill
kernel for every prefill sequence (chunked prefill and prefix-cache hits: the cached context is
read in place through the block tables). The kernels are in `triton_attention.py`.

Every query reads its keys and values from the cache, the fresh ones included, as the torch
backend does: a prompt computed whole or in chunks sees the same numbers. Nothing here reads a
tensor value on the host, so a decode step over this backend can be captured as a CUDA graph
(worker/cuda_graphs.py). Caches: float32 / bfloat16 / float16, and fp8 (e4m3 / e5m2) with the
layer's per-KV-head scales; int8 blocks (their scales inside the block) are the torch backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.layers.backends import triton_attention as kernels
from pagedllm.layers.backends.torch_paged import redo_bidirectional_prefills

if TYPE_CHECKING:
    from pagedllm.layers.attention import AttentionMetadata

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, *FP8_DTYPES)


class TritonPagedAttentionBackend:
    name = "triton"
    capture_safe = True  # no host synchronisation: decode steps may be captured as CUDA graphs

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
        -> attention output `[T, Hq, D]` (decodes first, then prefills, as the metadata says);
        `logits_soft_cap`: the scores' soft cap (None: none)."""
        md = attn_metadata
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if key_cache.dtype not in FP8_DTYPES:
            k_scale = v_scale = None
        kernels.write_kv_cache(key, value, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = md.num_decode_tokens
        if nd:
            kernels.paged_decode_attention(
                query[:nd], key_cache, value_cache, md.decode_block_tables, md.decode_context_lens, scale,
                sliding_window, k_scale, v_scale, out=out[:nd], logits_soft_cap=logits_soft_cap,
            )  # fmt: skip
        if md.num_prefills:
            if md.prefill_query_start_loc is None or md.prefill_block_tables_padded is None:
                raise ValueError("the Triton backend needs the prefill part as tensors "
                                 "(AttentionMetadata.prefill_query_start_loc, prefill_block_tables_padded)")
            kernels.paged_prefill_attention(
                query[nd:], key_cache, value_cache, md.prefill_block_tables_padded, md.prefill_query_start_loc,
                md.prefill_context_lens_tensor, scale, md.max_prefill_query_len, sliding_window, k_scale, v_scale,
                out=out[nd:], logits_soft_cap=logits_soft_cap,
            )  # fmt: skip
            if md.prefill_bidirectional_spans:  # Gemma 3's image blocks: the kernel is causal only
                redo_bidirectional_prefills(query, key, value, kv_cache, md, scale, sliding_window, k_scale, v_scale,
                                            float(logits_soft_cap or 0.0), out)
        return out
