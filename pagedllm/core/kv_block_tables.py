"""The KV cache manager's block tables and what the runner's copy of them needs.

The state every part of the manager reads (declared here, set by `KVCacheManager.__init__`),
the helpers they share (live entries, blocks per token count), and the table deltas and
released ids sent to the runner (worker/block_table.py). The base of the prefix cache, the
swap and the invariant checks, so each of them can be read (and typed) on its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.block_pool import BlockHash, BlockPool, KVBlock
from pagedllm.core.kv_cache_groups import KVCacheGroup, KVCacheGroups


class KVBlockTables:
    """Per-group block tables (device and host) and the runner's view of them."""

    block_size: int
    enable_caching: bool
    kv_cache_groups: KVCacheGroups
    groups: tuple[KVCacheGroup, ...]
    block_pool: BlockPool
    host_pool: BlockPool | None
    _per_group: bool
    tables: list[dict[int, list[KVBlock]]]
    host_tables: list[dict[int, list[KVBlock]]]
    req_to_blocks: dict[int, list[KVBlock]]
    swapped_tables: dict[int, list[KVBlock]]
    null_block: KVBlock | None
    num_dead_blocks_freed: int
    req_to_block_hashes: dict[int, list[BlockHash]]
    _pending_copies: list[tuple[int, int]]
    _pending_swap_out: list[tuple[int, int]]
    _pending_swap_in: list[tuple[int, int]]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_swapped_out: int
    num_swapped_in: int
    synced: list[dict[int, int]]
    _synced: dict[int, int]
    _released: list[int]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, seq_id: int, group: int = 0) -> list[int]:
        return [b.block_id for b in self.tables[group].get(seq_id, ())]

    @property
    def is_hybrid(self) -> bool:
        """Per-group tables (prefix hits as one list per group): several groups, or a single
        sliding-window group (a model with one window on every layer)."""
        return self._per_group

    def _is_null(self, block: KVBlock) -> bool:
        return block is self.null_block

    def _live(self, table: Iterable[KVBlock]) -> list[KVBlock]:
        null = self.null_block
        return [b for b in table if b is not null]

    # ---- what the runner's copy of the tables needs ---------------------------------------

    def take_table_delta(self, seq_id: int, group: int = 0) -> tuple[int, list[int]]:
        """(start, ids): the runner's table of `seq_id` becomes its first `start` ids followed by
        `ids` (start 0: a new table). Usually one new block or nothing; the runner then holds the
        whole table. A sliding group's dead entries turning null are not sent: the runner's
        stale ids there are never read unmasked."""
        table = self.tables[group].get(seq_id, ())
        synced = self.synced[group]
        start = synced.get(seq_id, 0)
        synced[seq_id] = len(table)
        return start, [b.block_id for b in table[start:]]

    def take_released(self) -> list[int]:
        """Sequences whose tables are gone since the last call: the runner drops its copies."""
        out, self._released = self._released, []
        return out

    def _forget_table(self, seq_id: int) -> None:
        found = False
        for synced in self.synced:
            found = synced.pop(seq_id, None) is not None or found
        if found:
            self._released.append(seq_id)
