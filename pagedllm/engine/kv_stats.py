"""KV cache statistics: how full the pool is, and how much of what is allocated holds tokens.

`waste_at_peak` is the number that shows paging works: at the step with the most blocks in use,
the fraction of allocated slots that hold no token (only the tail of each sequence's last
block, so it stays small). `shared_blocks` counts blocks held by more than one sequence
(parallel samples, beams, prefix hits): what sharing saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from pagedllm.core.block_pool import KVBlock
from pagedllm.core.request import SequenceState


@dataclass
class KVCacheStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    peak_used_blocks: int
    tokens_stored: int
    peak_tokens_stored: int
    waste_at_peak: float  # 1 - tokens / (blocks * block_size) at the peak of used blocks
    num_preemptions: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    shared_blocks: int = 0  # blocks with ref_count > 1 now
    peak_shared_blocks: int = 0
    num_swapped_out: int = 0  # blocks copied to host memory by swap preemption, cumulative
    num_swapped_in: int = 0  # blocks copied back, cumulative
    # A hybrid KV cache (docs/hybrid_kv_cache.md): its groups, and the blocks its sliding groups
    # handed back as their windows moved on, cumulative.
    num_kv_cache_groups: int = 1
    sliding_blocks_freed: int = 0
    used_blocks_by_group: list[int] = field(default_factory=list)  # now, per group


class KVCacheStatsTracker:
    """Follows used blocks and stored tokens step by step and remembers the peak."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.used_blocks = 0
        self.tokens_stored = 0
        self.peak_used_blocks = 0
        self.peak_tokens_stored = 0
        self.shared_blocks = 0
        self.peak_shared_blocks = 0

    @staticmethod
    def count_stored_tokens(
        running: Iterable[SequenceState], block_ids_of, block_size: int
    ) -> int:
        """Tokens held in the cache, counting a block shared by several sequences once."""
        filled: dict[int, int] = {}
        for seq in running:
            computed = seq.num_computed_tokens
            for i, block_id in enumerate(block_ids_of(seq.seq_id)):
                n = min(block_size, computed - i * block_size)
                if n <= 0:
                    break
                if n > filled.get(block_id, 0):
                    filled[block_id] = n
        return sum(filled.values())

    @staticmethod
    def stored_tokens(
        running: Iterable[SequenceState],
        tables: Mapping[int, list[KVBlock]],
        block_size: int,
        num_shared_blocks: int,
    ) -> int:
        """`count_stored_tokens` without walking every block (it runs twice a step).

        A block held by one sequence holds `min(block_size, computed - i * block_size)` of its
        tokens, so a sequence's unshared blocks together hold `min(computed, blocks *
        block_size)`: one addition per sequence. Only shared blocks (`ref_count > 1`) need the
        maximum over their holders, and those sit at the start of the tables (prefix hits,
        forks): each table is walked only while its blocks are shared. That is exact when the
        walk saw every reference of every shared block; where it did not (a shared block
        behind an unshared one), the full walk decides.
        """
        total = 0
        seen: dict[int, list] = {}  # block_id -> [block, references seen, max tokens]
        overlap = 0  # tokens of shared blocks counted once per holder in `total`
        for seq in running:
            table = tables.get(seq.seq_id)
            if not table:
                continue
            computed = seq.num_computed_tokens
            full = len(table) * block_size
            total += computed if computed < full else full
            if not num_shared_blocks:
                continue
            for i, block in enumerate(table):
                if block.ref_count < 2:
                    break
                n = min(block_size, computed - i * block_size)
                if n <= 0:
                    break
                overlap += n
                entry = seen.get(block.block_id)
                if entry is None:
                    seen[block.block_id] = [block, 1, n]
                else:
                    entry[1] += 1
                    if n > entry[2]:
                        entry[2] = n
        if not num_shared_blocks:
            return total
        if len(seen) == num_shared_blocks and all(b.ref_count == k for b, k, _ in seen.values()):
            return total - overlap + sum(n for _, _, n in seen.values())
        return KVCacheStatsTracker.count_stored_tokens(
            running, lambda seq_id: [b.block_id for b in tables.get(seq_id, ())], block_size
        )

    def observe(self, used_blocks: int, tokens_stored: int, shared_blocks: int = 0) -> None:
        self.used_blocks = used_blocks
        self.tokens_stored = tokens_stored
        self.shared_blocks = shared_blocks
        self.peak_shared_blocks = max(self.peak_shared_blocks, shared_blocks)
        if used_blocks > self.peak_used_blocks or (
            used_blocks == self.peak_used_blocks and tokens_stored > self.peak_tokens_stored
        ):
            self.peak_used_blocks = used_blocks
            self.peak_tokens_stored = tokens_stored

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.used_blocks
        self.peak_tokens_stored = self.tokens_stored
        self.peak_shared_blocks = self.shared_blocks

    def snapshot(
        self, num_preemptions: int, queries: int, hits: int, swapped_out: int = 0,
        swapped_in: int = 0,
    ) -> KVCacheStats:
        slots = self.peak_used_blocks * self.block_size
        waste = 1.0 - self.peak_tokens_stored / slots if slots else 0.0
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=self.used_blocks,
            peak_used_blocks=self.peak_used_blocks,
            tokens_stored=self.tokens_stored,
            peak_tokens_stored=self.peak_tokens_stored,
            waste_at_peak=waste,
            num_preemptions=num_preemptions,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            shared_blocks=self.shared_blocks,
            peak_shared_blocks=self.peak_shared_blocks,
            num_swapped_out=swapped_out,
            num_swapped_in=swapped_in,
        )
