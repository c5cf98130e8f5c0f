"""KV cache groups: layers grouped by attention type, so that each group keeps only the blocks
its attention can still read (issue 25; docs/hybrid_kv_cache.md).

A model whose layers all attend the same way has one group holding every layer. Full causal
everywhere: no groups at all, the engine behaves exactly as with one block table. One sliding
window everywhere (Mistral, Phi-3-mini-4k): one sliding group, whose dead blocks go back.
A hybrid model (Gemma 2: sliding and full alternate; Gemma 3: five sliding to one full) gets
one table per group per sequence. All groups draw from one block pool, as in vLLM v1: every
group holds the same number of layers (`slots`), the cache keeps one K/V tensor per slot, and
a block id names that block in every slot tensor, owned by one group at a time. Layers of a
type whose count is not a multiple of the slot count leave slots unused in their last group.

Why equal-sized groups: a block then costs the same bytes whichever group holds it, so one
free list serves all groups and the scheduler's arithmetic stays "blocks", not bytes.

Pure Python (core/ is torch-free): the model side supplies each layer's window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block tables; `layer_ids[j]` lives in slot tensor j."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None  # None: full causal attention

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def first_live_position(self, num_computed_tokens: int) -> int:
        """The earliest key position a query at `num_computed_tokens` or later can read: a
        query at q sees keys k with q - k < window (transformers' rule)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def num_dead_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks no present or future query of the sequence reads."""
        return self.first_live_position(num_computed_tokens) // block_size

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        """The most blocks the group holds for one sequence of `num_tokens` (admission, sizing):
        a sliding group at most the blocks a window spans, one more when it straddles."""
        total = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return total
        return min(total, -(-(self.sliding_window - 1) // block_size) + 1)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks the group holds in a step of at most `chunk` new tokens of a
        sequence up to `num_tokens` long (after the dead blocks went): a step computing
        [c, c + n) holds ceil((c + n) / B) - (c - W + 1) // B, at most
        ceil((B + W - 2 + n) / B)."""
        total = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return total
        n = max(1, min(chunk, num_tokens))
        return min(total, -(-(block_size + self.sliding_window - 2 + n) // block_size))


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's groups; `slots` layers per group (one K/V tensor per slot)."""

    groups: tuple[KVCacheGroup, ...]
    slots: int

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    def layer_slot(self) -> dict[int, tuple[int, int]]:
        """layer id -> (group index, slot index)."""
        return {layer: (gi, si) for gi, g in enumerate(self.groups)
                for si, layer in enumerate(g.layer_ids)}

    def blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """Pool blocks one sequence of `num_tokens` holds at most, summed over groups."""
        return sum(g.max_live_blocks(num_tokens, block_size) for g in self.groups)

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most pool blocks one sequence of up to `num_tokens` holds in a step of at most
        `chunk` new tokens (what "fits in an empty pool" means)."""
        return sum(g.peak_blocks(num_tokens, block_size, chunk) for g in self.groups)

    @property
    def has_null_block(self) -> bool:
        """A sliding group points its dead entries at a reserved block."""
        return any(g.is_sliding for g in self.groups)

    def layer_blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """Layer-blocks (a block of one layer's K/V) the pool spends on one sequence: what is
        held, unused slots included."""
        return self.slots * self.blocks_per_sequence(num_tokens, block_size)

    @staticmethod
    def theoretical_min_layer_blocks(windows: Sequence[int | None], num_tokens: int,
                                     block_size: int) -> int:
        """Full layers x length + sliding layers x window, each rounded up to blocks."""
        full = -(-num_tokens // block_size)
        return sum(full if w is None else min(full, -(-min(w, num_tokens) // block_size))
                   for w in windows)


def group_layers(windows: Sequence[int | None]) -> KVCacheGroups:
    """Group layers by attention type. `windows[i]`: layer i's sliding window, None for full.

    One type: one group of every layer (today's layout). Several: every group holds `slots`
    layers, the count of the rarest type (vLLM v1's uniform page size), so no type wastes more
    than one partly filled group.
    """
    if not windows:
        raise ValueError("a model needs at least one attention layer")
    for i, w in enumerate(windows):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"layer {i}: sliding window must be a positive int or None, got {w!r}")
    by_type: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        by_type.setdefault(w, []).append(layer)
    if len(by_type) == 1:
        (w, layers), = by_type.items()
        return KVCacheGroups((KVCacheGroup(tuple(layers), w),), len(layers))
    slots = min(len(layers) for layers in by_type.values())
    groups: list[KVCacheGroup] = []
    # full attention first, then windows in increasing size: a stable, readable order
    for w in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[w]
        for start in range(0, len(layers), slots):
            groups.append(KVCacheGroup(tuple(layers[start:start + slots]), w))
    return KVCacheGroups(tuple(groups), slots)


def layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    """The attention window of one layer (None: full causal attention), as transformers decides."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if hf_config.model_type == "qwen2":
        return window if layer_idx >= getattr(hf_config, "max_window_layers", 0) else None
    return window


def hybrid_kv_cache_groups(hf_config: Any, disabled: bool = False) -> KVCacheGroups | None:
    """The KV cache groups of a model with sliding-window layers (mixed with full ones, or one
    window everywhere): its sliding layers then keep only their window's blocks. None for a
    model whose layers all attend fully (one block table for every layer, as always) or when
    `disabled` (`--disable-hybrid-kv-cache-manager`)."""
    if disabled:
        return None
    return hybrid_groups_of_windows(layer_sliding_windows(hf_config))


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Every layer's attention window (None: full attention)."""
    return [layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)]


def hybrid_groups_of_windows(windows: list[int | None]) -> KVCacheGroups | None:
    """The hybrid groups of layers with these windows; None where one block table serves all
    (or no windows: a core's hand-shake sends none unless its cache is hybrid). The API process
    builds them from the windows in the core's hand-shake (it loads no model config)."""
    if not windows:
        return None
    groups = group_layers(windows)
    return groups if groups.has_null_block else None
