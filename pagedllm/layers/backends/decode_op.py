"""Decode attention as one opaque torch operator: `torch.ops.pagedllm.paged_decode_attention`.

It writes the decode tokens' K/V into the paged cache and attends each one-token query over its
sequence's context. Being a registered custom op (with its cache mutation declared), it is a
single node to `torch.compile`: the compiled decode step (worker/decode_graphs.py) traces the
model around it, while the op's own data-dependent work (context lengths, block tables) stays
eager. The eager path calls the same function (`paged_decode_attention_eager`) directly, without
the dispatcher's ~35 us per call, so both paths run one implementation.

On CPU with float32 the attention runs in the C kernel (kernels/paged_decode_attention.c), which
reads K/V in place from their blocks; otherwise (other dtypes, GPU, no compiler) the torch path
gathers the used blocks and calls SDPA with an additive mask.

No `from __future__ import annotations` here: `custom_op` reads the signature's real types.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.kernels import decode_attention_kernel
from pagedllm.layers.backends.paged_ops import decode_mask, gather_blocks, write_to_kv_cache

_c_kernel = decode_attention_kernel


def decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """Portable decode attention: gather the used blocks, mask, SDPA. `query [D, Hq, dh]`."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_blocks = -(-int(context_lens.max()) // block_size)
    tables = block_tables[:, :max_blocks]
    mask = decode_mask(context_lens, max_blocks * block_size, sliding_window, query.dtype)
    k = gather_blocks(key_cache, tables).transpose(1, 2)  # [D, Hk, L, dh]
    v = gather_blocks(value_cache, tables).transpose(1, 2)
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # grouped by KV head
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t [S, H, D]` with unit strides inside a row (rows may be apart, as views into the fused
    qkv projection are); copied only if it is not."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode_attention_c(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
    new_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> Optional[torch.Tensor]:
    """The C kernel's decode attention, or None where it does not apply. With `new_kv = (key,
    value, slot_mapping)` the kernel first stores the new K/V rows at their slots."""
    kernel = _c_kernel()
    if (
        kernel is None
        or query.device.type != "cpu"
        or not (query.dtype == key_cache.dtype == value_cache.dtype == torch.float32)
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        return None
    query = _rows(query)
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    key_ptr = value_ptr = slots_ptr = None
    kv_stride = 0
    if new_kv is not None:
        key, value, slots = new_kv
        if key.dtype != torch.float32 or value.dtype != torch.float32:
            return None
        key, value = _rows(key), _rows(value)
        if key.stride(0) != value.stride(0):
            key, value = key.contiguous(), value.contiguous()
        slots = slots.to(torch.int64).contiguous()
        key_ptr, value_ptr, slots_ptr, kv_stride = key.data_ptr(), value.data_ptr(), slots.data_ptr(), key.stride(0)
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    failed = kernel(
        query.data_ptr(), query.stride(0), key_ptr, value_ptr, kv_stride, slots_ptr,
        key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        num_blocks, scale, sliding_window or 0, torch.get_num_threads(),
    )  # fmt: skip
    if failed == 2:
        raise ValueError("paged decode attention: a slot is outside the KV cache")
    if failed:
        raise ValueError("paged decode attention: a context length is 0 or exceeds its block table")
    return out


def paged_decode_attention_eager(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """Write `key/value [D, Hk, dh]` at `slot_mapping` of `kv_cache [2, blocks, block_size, Hk,
    dh]`, then attend `query [D, Hq, dh]` over the first `context_lens[i]` positions of block
    table row `i` -> `[D, Hq, dh]`."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window)
    out = decode_attention_c(*args, new_kv=(key, value, slot_mapping))
    if out is not None:
        return out
    write_to_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return decode_attention_torch(*args)


paged_decode_attention = torch.library.custom_op(
    "pagedllm::paged_decode_attention", paged_decode_attention_eager, mutates_args=("kv_cache",)
)


@paged_decode_attention.register_fake
def _(query, key, value, kv_cache, slot_mapping, block_tables, context_lens, scale, sliding_window):
    return torch.empty_like(query)
