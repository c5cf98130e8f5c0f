"""Paged attention layer and the metadata that describes one step's batch.

The flattened batch holds `T` query tokens: first `num_decode_tokens` decode sequences (exactly
one query token each), then the prefill sequences (every other sequence: a prompt, a chunk of a
prompt on top of cached context, or the uncached tail after a prefix-cache hit). The layer first
writes the step's K/V into the paged cache at `slot_mapping`, then reads each sequence's context
back through its block table. `AttentionMetadata` is built once per step by the model runner and
passed as an argument through the model's forward; masks derived from it are memoised on it so
that the layers share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.layers.backends import get_attn_backend


@dataclass
class AttentionMetadata:
    """One step's batch layout for attention. Token order: decodes first, then prefills."""

    slot_mapping: torch.Tensor  # LongTensor[T]: cache slot of every query token
    block_size: int
    # Decode part: tokens [0, num_decode_tokens), one per sequence.
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # LongTensor[D, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # LongTensor[D], including the current token
    # Prefill part: one entry per prefill sequence.
    prefill_query_starts: list[int] = field(default_factory=list)  # offset in the flattened batch
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_context_lens: list[int] = field(default_factory=list)  # cached + new tokens
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)  # LongTensor[ceil(ctx/B)]
    # The same tables as one LongTensor[P, max_blocks] for the prefill kernel (entries past a
    # sequence's own blocks are never read); None: the per-sequence torch path only.
    prefill_block_tables_padded: torch.Tensor | None = None
    # The prefill part as device tensors, for kernels that take the whole varlen batch (Triton):
    # int32 [P + 1] query offsets relative to the first prefill token, int32 [P] context lengths,
    # and the longest query (a host int: it sizes the kernel's grid).
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_context_lens_tensor: torch.Tensor | None = None
    max_prefill_query_len: int = 0
    # Each prefill sequence's whole length when scheduled (prompt + output so far; >= its
    # context length): a length-dependent positional encoding (Phi-3 LongRoPE) reads it.
    prefill_seq_lens: list[int] = field(default_factory=list)
    # Image blocks attended bidirectionally at prefill (Gemma 3, worker/mm_embeddings.py): per
    # prefill sequence, absolute (start, end) positions whose queries also see every key of the
    # same span (sliding windows still apply). [] (every text-only step): all causal, and the
    # backends take their usual kernels; non-empty: those sequences take the masked torch path.
    prefill_bidirectional_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    # Masks shared by all layers of one forward, keyed by (kind, sequence, sliding window).
    _mask_cache: dict[Any, torch.Tensor | None] = field(default_factory=dict, repr=False, compare=False)
    # A hybrid KV cache (core/kv_cache_groups.py): the metadata of groups 1.., the same batch
    # with that group's block tables and slot mapping (this object is group 0's).
    group_metadata: list["AttentionMetadata"] = field(default_factory=list, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        return self if group == 0 else self.group_metadata[group - 1]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def cached_mask(self, key: Any, build) -> torch.Tensor | None:
        if key not in self._mask_cache:
            self._mask_cache[key] = build()
        return self._mask_cache[key]


def check_soft_cap(cap: float | None) -> float | None:
    """A logit soft cap as the backends take it (None: no capping); ValueError unless positive and finite."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {cap!r}")
    return float(cap)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache.

    `forward(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], kv_cache, attn_metadata) -> [T, Hq * D]`.
    `kv_cache` is this layer's cache `[2, num_blocks, block_size, Hk, D]` (keys, values).

    `k_scale` / `v_scale` (float32 buffers [Hk], ones unless the checkpoint has them): an fp8
    cache's per-KV-head scales (stored = x / scale, read = stored * scale; docs/kv_cache.md),
    passed to the backend on every call and ignored by other cache types. Not persistent: a
    state dict without them (every float checkpoint) loads as before.

    `logits_soft_cap` (Gemma 2's `attn_logit_softcapping`; None: none): every backend replaces
    each scaled score `s` by `cap * tanh(s / cap)` before the mask and the softmax.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        device: torch.device | str | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # The KV cache group whose block tables this layer reads (set by the runner; 0 unless
        # the cache is hybrid).
        self.kv_cache_group = 0
        self.logits_soft_cap = check_soft_cap(logits_soft_cap)
        self.backend = get_attn_backend()
        self.k_scale: torch.Tensor
        self.v_scale: torch.Tensor
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device), persistent=False)

    @torch.no_grad()
    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """Set `k_scale` or `v_scale` from a checkpoint tensor: one scale (any shape of one
        element: expanded to every KV head) or one per KV head of this layer (`[Hk]`, or
        `[Hk, 1, ...]`; under tensor parallelism already cut to this rank's heads). ValueError
        for another size, or a scale that is not positive and finite (x / 0 is inf)."""
        if which not in ("k_scale", "v_scale"):
            raise ValueError(f"load_kv_scale: which must be 'k_scale' or 'v_scale', got {which!r}")
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if flat.numel() not in (1, self.num_kv_heads):
            raise ValueError(f"a KV cache {which} must be one scale or one per KV head ({self.num_kv_heads}), "
                             f"got shape {tuple(tensor.shape)}")
        if not bool(torch.isfinite(flat).all() & (flat > 0).all()):
            raise ValueError(f"a KV cache {which} must be positive and finite, got {flat.tolist()}")
        getattr(self, which).copy_(flat.expand(self.num_kv_heads))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        out = self.backend.forward(
            query,
            key,
            value,
            kv_cache,
            attn_metadata.for_group(self.kv_cache_group),
            scale=self.scale,
            sliding_window=self.sliding_window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            logits_soft_cap=self.logits_soft_cap,
        )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, logits_soft_cap={self.logits_soft_cap}, backend={self.backend.name}"
        )


def set_attn_backend(model: nn.Module, backend: type) -> None:
    """Make every attention layer of `model` use `backend` (the worker's choice, once the model
    is loaded: `layers.backends.select_attn_backend`)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
