"""Decode attention as one opaque torch operator: `torch.ops.pagedllm.paged_decode_attention`.

It writes the decode tokens' K/V into the paged cache and attends each one-token query over its
sequence's context. Being a registered custom op (with its cache mutation declared), it is a
single node to `torch.compile`: the compiled decode step (worker/decode_graphs.py) traces the
model around it, while the op's own data-dependent work (context lengths, block tables) stays
eager. The eager path calls the same function (`paged_decode_attention_eager`) directly, without
the dispatcher's ~35 us per call, so both paths run one implementation.

On CPU with float32 queries the attention runs in the C kernel (kernels/paged_decode_attention.c),
which reads K/V in place from their blocks, float32, bfloat16 or int8 (layers/kv_cache_dtype.py);
otherwise (float16 and fp8 caches, other model dtypes, GPU, no compiler) the torch path gathers
the used blocks (converted or dequantized) and calls SDPA with an additive mask. An fp8 cache's
per-layer scales (`k_scale`, `v_scale` [Hk]) are optional tensor arguments of the op, so a
compiled decode graph passes them like any other input (other cache types ignore them).

`logits_soft_cap` (Gemma 2's `attn_logit_softcapping`; 0: none) caps every scaled score as
`cap * tanh(score / cap)` before the softmax: in the C kernel (its `_softcap` entry point), and
in the torch path by explicit matmuls (`paged_ops.softcap_attention`: SDPA cannot cap).

No `from __future__ import annotations` here: `custom_op` reads the signature's real types.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.kernels import decode_attention_kernel
from pagedllm.layers.backends.paged_ops import (
    decode_mask,
    gather_blocks,
    softcap_attention,
    softcap_kernel,
    write_to_kv_cache,
)
from pagedllm.layers.kv_cache_dtype import KERNEL_KIND, KVHalf, split_kv_cache

# `paged_decode_attention_softcap`: the kernel build.py binds, plus the soft cap (0: none); the C
# decode step (worker/cpu_decode_step.py) calls the same function.
_c_kernel = softcap_kernel(decode_attention_kernel, "paged_decode_attention.c", "paged_decode_attention_softcap")
decode_softcap_kernel = _c_kernel


def decode_attention_torch(
    query: torch.Tensor,
    key_cache: KVHalf,
    value_cache: KVHalf,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Portable decode attention: gather the used blocks (in the query's dtype), mask, SDPA (or
    the soft-capped attention). `query [D, Hq, dh]`; the caches `[blocks, block_size, Hk, dh]`
    tensors, int8 views or fp8 `ScaledBlocks`."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_blocks = -(-int(context_lens.max()) // block_size)
    tables = block_tables[:, :max_blocks]
    mask = decode_mask(context_lens, max_blocks * block_size, sliding_window, query.dtype)
    k = gather_blocks(key_cache, tables, query.dtype).transpose(1, 2)  # [D, Hk, L, dh]
    v = gather_blocks(value_cache, tables, query.dtype).transpose(1, 2)
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # grouped by KV head
    if logits_soft_cap:
        o = softcap_attention(q, k, v, mask, scale, logits_soft_cap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t [S, H, D]` with unit strides inside a row (rows may be apart, as views into the fused
    qkv projection are); copied only if it is not."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode_attention_c(
    query: torch.Tensor,
    key_cache: KVHalf,
    value_cache: KVHalf,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
    new_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    logits_soft_cap: float = 0.0,
) -> Optional[torch.Tensor]:
    """The C kernel's decode attention, or None where it does not apply (not CPU, queries not
    float32, a cache type the kernel lacks: float16, fp8). With `new_kv = (key, value,
    slot_mapping)` the kernel first stores the new K/V rows at their slots (converted /
    quantized). `logits_soft_cap` > 0 caps the scores (0: none)."""
    kernel = _c_kernel()
    kind = KERNEL_KIND.get(key_cache.dtype)
    if (
        kernel is None
        or kind is None
        or query.device.type != "cpu"
        or query.dtype != torch.float32
        or value_cache.dtype != key_cache.dtype
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        return None
    _check_shapes(query, key_cache, value_cache, block_tables, context_lens, new_kv)
    query = _rows(query)
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    key_ptr = value_ptr = slots_ptr = None
    kv_stride = 0
    slots = None
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
        kind, query.data_ptr(), query.stride(0), key_ptr, value_ptr, kv_stride, slots_ptr,
        key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        num_blocks, scale, sliding_window or 0, torch.get_num_threads(), logits_soft_cap,
    )  # fmt: skip
    if failed:
        _raise_failure(failed, block_tables, context_lens, slots, num_blocks, block_size, sliding_window)
    return out


def _check_shapes(query, key_cache, value_cache, block_tables, context_lens, new_kv) -> None:
    """What the kernel is about to read must have the shapes it assumes (a few integer compares:
    this runs in every layer of every decode step)."""
    if query.dim() != 3 or len(key_cache.shape) != 4:
        raise ValueError(f"paged decode attention: query must be [seqs, heads, head_dim] and the cache "
                         f"[blocks, block_size, kv_heads, head_dim], got query {tuple(query.shape)}, "
                         f"key_cache {tuple(key_cache.shape)}")
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"paged decode attention: value_cache {tuple(value_cache.shape)} != key_cache "
                         f"{tuple(key_cache.shape)}")
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"paged decode attention: query head_dim {head_dim} != the cache's head_dim "
                         f"{key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"paged decode attention: {num_heads} query heads are not a multiple of the "
                         f"cache's {num_kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged decode attention: block_tables {tuple(block_tables.shape)} must be "
                         f"[{num_seqs} sequences, max blocks]")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"paged decode attention: context_lens {tuple(context_lens.shape)} must be "
                         f"({num_seqs},), one per sequence")
    if new_kv is not None:
        key, value, slots = new_kv
        want = (num_seqs, num_kv_heads, head_dim)
        if key.shape != want or value.shape != want:
            raise ValueError(f"paged decode attention: new key {tuple(key.shape)} / value "
                             f"{tuple(value.shape)} must be {want}")
        if slots.shape != (num_seqs,):
            raise ValueError(f"paged decode attention: slot_mapping {tuple(slots.shape)} must be "
                             f"({num_seqs},), one slot per sequence")


def _raise_failure(failed, block_tables, context_lens, slots, num_blocks, block_size, window) -> None:
    """The kernel refused its input (nothing was read out of bounds): name the offending value.
    Only on this error path, so plain Python loops are fine."""
    if failed & 2:
        limit = num_blocks * block_size
        s, v = next((s, v) for s, v in enumerate(slots.tolist()) if not 0 <= v < limit)
        raise ValueError(f"paged decode attention: slot {v} of sequence {s} is outside the KV cache's "
                         f"slots [0, {limit})")
    width = block_tables.shape[1]
    for s, ctx in enumerate(context_lens.tolist()):
        start = ctx - window if window and ctx > window else 0
        if ctx - start <= 0 or -(-ctx // block_size) > width:
            raise ValueError(f"paged decode attention: context length {ctx} of sequence {s} is 0 or "
                             f"exceeds its block table ({width} blocks of {block_size})")
        row = block_tables[s].tolist()
        for j in range(start // block_size, (ctx - 1) // block_size + 1):
            if not 0 <= row[j] < num_blocks:
                raise ValueError(f"paged decode attention: block id {row[j]} (sequence {s}, table entry "
                                 f"{j}) is outside the KV cache's blocks [0, {num_blocks})")
    if failed & 8:
        raise MemoryError("paged decode attention: no memory for a work buffer")
    raise ValueError(f"paged decode attention: the kernel refused its input (code {failed})")


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
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Write `key/value [D, Hk, dh]` at `slot_mapping` of `kv_cache [2, blocks, block_size, Hk,
    dh]`, then attend `query [D, Hq, dh]` over the first `context_lens[i]` positions of block
    table row `i` -> `[D, Hq, dh]`. `k_scale` / `v_scale` [Hk]: an fp8 cache's (needed there);
    `logits_soft_cap` > 0: the scores soft-capped (0: none)."""
    key_cache, value_cache = split_kv_cache(kv_cache, key.shape[1], key.shape[2], k_scale, v_scale)
    args = (query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window)
    out = decode_attention_c(*args, new_kv=(key, value, slot_mapping), logits_soft_cap=logits_soft_cap)
    if out is not None:
        return out
    write_to_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return decode_attention_torch(*args, logits_soft_cap)


paged_decode_attention = torch.library.custom_op(
    "pagedllm::paged_decode_attention", paged_decode_attention_eager, mutates_args=("kv_cache",)
)


@paged_decode_attention.register_fake
def _(query, key, value, kv_cache, slot_mapping, block_tables, context_lens, scale, sliding_window,
      k_scale=None, v_scale=None, logits_soft_cap=0.0):
    return torch.empty_like(query)
