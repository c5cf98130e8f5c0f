"""Prefill attention of all the step's prefill sequences in one call of the C kernel
(kernels/paged_prefill_attention.c): it stores their new K/V at their slots, then attends each
query over its sequence's context read in place from the blocks (bottom-right aligned causal
mask, optional sliding window). No Python loop over the sequences, no gather of cached context.

The cache may hold float32, bfloat16 or int8 (layers/kv_cache_dtype.py): the kernel converts
as it loads, and its queries attend to the cache's values, their own new rows included.
float16 and fp8 caches are not the kernel's (no element kind for them): it declines them.

`logits_soft_cap` (Gemma 2; 0: none) caps the scaled scores in the kernel (its `_softcap` entry
point) as `cap * tanh(score / cap)`, before the mask and the softmax.

`prefill_attention_c` returns None where the kernel does not apply (no compiler, kernels
disabled, not CPU, not float32 activations, a float16 / fp8 cache, no 2-D prefill block table
in the metadata); the caller then takes the portable torch path (layers/backends/torch_paged.py:
per sequence, SDPA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.kernels import prefill_attention_kernel
from pagedllm.layers.backends.paged_ops import softcap_kernel
from pagedllm.layers.kv_cache_dtype import KERNEL_KIND, KVHalf

if TYPE_CHECKING:
    from pagedllm.layers.attention import AttentionMetadata

# `paged_prefill_attention_softcap`: the kernel build.py binds, plus the soft cap (0: none).
_c_kernel = softcap_kernel(prefill_attention_kernel, "paged_prefill_attention.c", "paged_prefill_attention_softcap")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t [T, H, D]` with unit strides inside a row (rows may be apart); copied only if not."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def _seq_arrays(md: AttentionMetadata) -> torch.Tensor:
    """int64 [3, P]: query start (within the prefill rows), query length, context length."""
    nd = md.num_decode_tokens

    def build() -> torch.Tensor:
        starts = [s - nd for s in md.prefill_query_starts]
        return torch.tensor([starts, md.prefill_query_lens, md.prefill_context_lens], dtype=torch.int64)

    return md.cached_mask(("prefill_kernel_lens",), build)


def prefill_attention_c(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: KVHalf,
    value_cache: KVHalf,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None = None,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor | None:
    """`query [Tp, Hq, dh]`, `key/value [Tp, Hk, dh]`: the prefill rows of the step (after the
    decodes). Stores key/value at `md.slot_mapping[nd:]`, returns `[Tp, Hq, dh]` (into `out`
    when given: a contiguous tensor of that shape), or None where the kernel does not apply."""
    kernel = _c_kernel()
    tables = md.prefill_block_tables_padded
    kind = KERNEL_KIND.get(key_cache.dtype)
    if (
        kernel is None
        or tables is None
        or kind is None
        or query.device.type != "cpu"
        or not (query.dtype == key.dtype == value.dtype == torch.float32)
        or value_cache.dtype != key_cache.dtype
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
    ):
        return None
    query, key, value = _rows(query), _rows(key), _rows(value)
    if key.stride(0) != value.stride(0):
        key, value = key.contiguous(), value.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_dim = key_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or kv_dim != head_dim:
        raise ValueError(
            f"paged prefill attention: key {tuple(key.shape)} does not match query {tuple(query.shape)} "
            f"and the cache's {num_kv_heads} KV heads of {kv_dim}"
        )
    nd = md.num_decode_tokens
    slots = md.slot_mapping[nd:].to(torch.int64).contiguous()
    if slots.shape[0] != num_tokens:
        raise ValueError(f"paged prefill attention: {slots.shape[0]} slots for {num_tokens} query rows")
    tables = tables.to(torch.int64).contiguous()
    lens = _seq_arrays(md)
    num_seqs = lens.shape[1]
    if tables.shape[0] != num_seqs:
        raise ValueError(f"paged prefill attention: {tables.shape[0]} block table rows for {num_seqs} sequences")
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    failed = kernel(
        kind, query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(), key.stride(0),
        slots.data_ptr(), num_tokens, key_cache.data_ptr(), value_cache.data_ptr(),
        tables.data_ptr(), tables.shape[1], lens[0].data_ptr(), lens[1].data_ptr(),
        lens[2].data_ptr(), num_seqs, out.data_ptr(), num_heads, num_kv_heads, head_dim,
        block_size, num_blocks, scale, sliding_window or 0, torch.get_num_threads(), logits_soft_cap,
    )  # fmt: skip
    if failed:
        _raise_for(failed, slots, tables, lens, num_blocks, block_size, num_tokens)
    return out


def _raise_for(code, slots, tables, lens, num_blocks, block_size, num_tokens) -> None:
    """The kernel refused its input (nothing was read or written): name the bad value."""
    if code == 3:
        for s in range(tables.shape[0]):
            used = -(-int(lens[2, s]) // block_size)
            for i, block_id in enumerate(tables[s, :used].tolist()):
                if not 0 <= block_id < num_blocks:
                    raise ValueError(
                        f"paged prefill attention: block id {block_id} of sequence {s} (table entry "
                        f"{i}) is outside [0, {num_blocks})"
                    )
    if code == 2:
        bad = slots[(slots < 0) | (slots >= num_blocks * block_size)]
        raise ValueError(
            f"paged prefill attention: slot {int(bad[0])} is outside the KV cache's "
            f"{num_blocks * block_size} slots"
        )
    for s in range(lens.shape[1]):
        start, q_len, ctx = (int(x) for x in lens[:, s])
        if q_len < 1 or q_len > ctx or start < 0 or start + q_len > num_tokens:
            raise ValueError(
                f"paged prefill attention: sequence {s} has query rows {start}..{start + q_len} "
                f"(of {num_tokens}) and context length {ctx}"
            )
        if -(-ctx // block_size) > tables.shape[1]:
            raise ValueError(
                f"paged prefill attention: context length {ctx} of sequence {s} exceeds its block "
                f"table ({tables.shape[1]} blocks of {block_size})"
            )
    raise ValueError(f"paged prefill attention: the kernel refused its input (code {code})")
