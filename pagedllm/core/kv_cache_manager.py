"""Per-sequence block tables on top of the BlockPool: allocation, prefix hits, fork, CoW, free.

A sequence's block table maps its positions to physical blocks:
`slot(pos) = table[pos // block_size] * block_size + pos % block_size`. Blocks are shared in two
ways: prefix-cache hits on full, hashed blocks (never written again), and `fork` (n > 1, beam
search), whose partly filled last block is copied on the first write (copy-on-write).

Swap preemption moves a group of sequences' blocks to a host pool (a second BlockPool without
caching) and back: the manager remaps the block tables and queues the (src, dst) copies that the
cache engine performs before the next forward, in the order swap-out, swap-in, copy-on-write.

The model runner keeps its own copy of every table (worker/block_table.py) and is sent only
what changed (`take_table_delta`): the manager knows, per sequence, how many leading ids the
runner holds as they are (`_synced`; lowered by a copy-on-write inside them, dropped with the
table), and which sequences' tables are gone (`take_released`: freed, swapped out), so no step
rebuilds or compares whole tables on either side.

KV cache groups (core/kv_cache_groups.py): a hybrid model's layers form groups, each with its
own table per sequence, all drawn from the one pool. Group 0 is `req_to_blocks` (for a model
with one attention type the only group: everything below is then what it always was). A
sliding group's table keeps its positions; blocks wholly before the window go back to the
pool as the sequence advances and their entries point at the reserved `null_block` (block 0,
held by the manager, zero-filled by the cache engine), which the kernels never read unmasked.
A prefix hit serves every group: its length is the longest prefix whose blocks each group can
give (a sliding group only the blocks its window reads); the pool keys a group's hashes by the
group.

Here: sizes, allocation with copy-on-write, fork and free. The tables and the runner's deltas
are in core/kv_block_tables.py, hashing and lookup in core/kv_prefix_cache.py, the swap in
core/kv_cache_swap.py, the consistency checks in core/kv_cache_invariants.py.
"""

from __future__ import annotations
from pagedllm.core.block_pool import BlockHash, BlockPool, KVBlock
from pagedllm.core.kv_cache_groups import KVCacheGroup, KVCacheGroups
from pagedllm.core.kv_cache_invariants import KVCacheInvariants
from pagedllm.core.kv_cache_swap import KVCacheSwap
from pagedllm.core.kv_prefix_cache import KVPrefixCache, PrefixHits
from pagedllm.core.request import SequenceState


class KVCacheManager(KVPrefixCache, KVCacheSwap, KVCacheInvariants):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        groups: KVCacheGroups | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be non-negative, got {num_host_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_cache_groups = groups if groups is not None else KVCacheGroups(
            (KVCacheGroup((), None),), 0)
        self.groups: tuple[KVCacheGroup, ...] = self.kv_cache_groups.groups
        self.block_pool = BlockPool(num_blocks, enable_caching, len(self.groups))
        # Host memory for swapped-out blocks: ref counts and a free queue, never hashed.
        self.host_pool = (BlockPool(num_host_blocks, False, len(self.groups)) if num_host_blocks
                          else None)
        self._per_group = groups is not None and (groups.is_hybrid or groups.has_null_block)
        # Per group: seq_id -> device table, seq_id -> host table (swapped out).
        self.tables: list[dict[int, list[KVBlock]]] = [{} for _ in self.groups]
        self.host_tables: list[dict[int, list[KVBlock]]] = [{} for _ in self.groups]
        self.req_to_blocks = self.tables[0]
        self.swapped_tables = self.host_tables[0]
        # The entry of a sliding table's dead positions (never freed, never hashed).
        self.null_block: KVBlock | None = None
        if self.kv_cache_groups.has_null_block:
            if num_blocks < 2:
                raise ValueError("a sliding-window group needs at least 2 blocks (one is the null block)")
            self.null_block = self.block_pool.take_reserved_block()
        self.num_dead_blocks_freed = 0  # sliding blocks returned to the pool, cumulative
        # Chain hashes of each sequence's full computed blocks, in order (the next block's
        # parent); kept even where the pool holds a duplicate and did not cache the block.
        self.req_to_block_hashes: dict[int, list[BlockHash]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_swap_out: list[tuple[int, int]] = []  # (device src, host dst)
        self._pending_swap_in: list[tuple[int, int]] = []  # (host src, device dst)
        self.prefix_cache_queries = 0  # tokens looked up (counted when a sequence is admitted)
        self.prefix_cache_hits = 0  # tokens found
        self.num_swapped_out = 0  # blocks copied device -> host, cumulative
        self.num_swapped_in = 0  # blocks copied host -> device, cumulative
        # Per group: seq_id -> how many leading ids of its table the runner holds unchanged
        self.synced: list[dict[int, int]] = [{} for _ in self.groups]
        self._synced = self.synced[0]
        self._released: list[int] = []  # tables gone since the last take_released

    # ---- sizes and statistics -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_shared_blocks(self) -> int:
        """Blocks referenced by more than one sequence right now."""
        return self.block_pool.num_shared_blocks

    @property
    def num_used_blocks_by_group(self) -> list[int]:
        """Blocks each KV cache group's tables hold now (the null block in none), O(1)."""
        return list(self.block_pool.num_used_by_group)

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of up to `num_tokens` holds in a step of at most
        `chunk` new tokens, over all groups (what "fits in an empty pool" means)."""
        return self.kv_cache_groups.peak_blocks(num_tokens, self.block_size, chunk)

    def num_blocks_to_resume(self, seq: SequenceState, chunk: int) -> int:
        """Free blocks beyond its host blocks that a swapped `seq` may take to finish: each
        group's peak less what it holds on the host, plus one copy-on-write per group."""
        return sum(
            max(0, g.peak_blocks(seq.num_tokens, self.block_size, chunk)
                - len(self._live(host.get(seq.seq_id, ())))) + 1
            for g, host in zip(self.groups, self.host_tables))
    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        seq: SequenceState,
        num_new_tokens: int,
        new_computed_blocks: PrefixHits | None = None,
    ) -> bool:
        """Make the tables cover this step's tokens; False (nothing changed) if the pool is short.

        Covers `num_computed_tokens + hit blocks * block_size + num_new_tokens` tokens. Prefix
        hits go first in an empty table (the caller then advances `num_computed_tokens`). A
        shared block in this step's write range is copied first (copy-on-write); the copy is
        queued for `take_pending_copies`. A sliding group first lets go of the blocks wholly
        before its window.
        """
        hits = new_computed_blocks or []
        B = self.block_size
        sid = seq.seq_id
        if not self.is_hybrid:
            table = self.req_to_blocks.get(sid, [])
            if table and not hits:  # the common decode step: covered, nothing shared
                first = seq.num_computed_tokens // B
                needed = -(-(seq.num_computed_tokens + num_new_tokens) // B)
                if needed <= len(table) and all(b.ref_count == 1 for b in table[first:needed]):
                    return True
        group_hits = hits if self.is_hybrid else ([hits] if hits else [])
        if group_hits and any(sid in t for t in self.tables):
            raise ValueError(f"seq {sid}: prefix hits given for a non-empty block table")
        num_hit_blocks = self._num_hit_blocks(hits)
        hit_hashes = self._check_hits(seq, group_hits)
        write_start = seq.num_computed_tokens + num_hit_blocks * B
        write_end = write_start + num_new_tokens
        num_required = self.num_blocks_needed(write_end)
        plans = []  # per group: (table, dead, cow positions, new blocks)
        fresh = freeable = 0
        hits_from_free: set[int] = set()
        for g, group in enumerate(self.groups):
            table = list(group_hits[g]) if group_hits else self.tables[g].get(sid, [])
            dead = min(group.num_dead_blocks(write_start, B), num_required)
            start = max(len(table), dead)
            num_new = max(0, num_required - start)
            cow = [i for i in range(max(write_start // B, dead), min(len(table), num_required))
                   if table[i].ref_count > 1]
            fresh += num_new + len(cow)
            freeable += sum(1 for b in table[:dead]
                            if b is not self.null_block and b.ref_count == 1)
            if group_hits:
                hits_from_free.update(b.block_id for b in table
                                      if b is not self.null_block and b.ref_count == 0)
            plans.append((table, dead, cow, num_new))
        # Capacity first: cached hits that sit in the free queue stop being free when touched.
        # Dead blocks held by this sequence alone go back to the pool before any is taken.
        if fresh > self.block_pool.num_free_blocks + freeable - len(hits_from_free):
            return False

        if not self.req_to_blocks.get(sid) and self._uses_prefix_cache(seq):  # admission
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_blocks * B
        if group_hits:
            self.req_to_block_hashes[sid] = hit_hashes
        if group_hits:  # every group's hits first: a fresh block must not evict one of them
            for table, _, _, _ in plans:
                self.block_pool.touch(self._live(table))
        for table, dead, _, _ in plans:  # then the blocks wholly behind a window go back
            if dead:
                self._drop_dead(table, dead)
        for g, (table, dead, cow, num_new) in enumerate(plans):
            synced = self.synced[g]
            if cow and synced.get(sid, 0) > cow[0]:
                synced[sid] = cow[0]  # the runner's copy is stale from there
            for i, new_block in zip(cow, self.block_pool.get_new_blocks(len(cow), g)):
                old_block = table[i]
                table[i] = new_block
                self._pending_copies.append((old_block.block_id, new_block.block_id))
                self.block_pool.free_blocks([old_block])  # still held by its other owners
            table.extend(self.block_pool.get_new_blocks(num_new, g))
            self.tables[g][sid] = table
        return True

    def trim(self, seq: SequenceState, num_tokens: int) -> int:
        """Give back every block past the first `num_tokens` slots of `seq`'s tables (rejected
        draft tokens' blocks, speculative decoding); returns how many went. Those blocks were
        written this step only, so none is hashed; the runner's copies are re-sent from the
        first dropped entry."""
        keep = self.num_blocks_needed(num_tokens)
        gone_total = 0
        for g, tables in enumerate(self.tables):
            table = tables.get(seq.seq_id)
            if table is None or len(table) <= keep:
                continue
            gone = self._live(table[keep:])
            del table[keep:]
            self.block_pool.free_blocks(reversed(gone))
            gone_total += len(gone)
            synced = self.synced[g]
            if synced.get(seq.seq_id, 0) > keep:
                synced[seq.seq_id] = keep
        return gone_total

    def _drop_dead(self, table: list[KVBlock], dead: int) -> None:
        """Free a sliding table's first `dead` entries (oldest first: evicted first) and point
        them at the null block; grow the table with null entries up to `dead`."""
        null = self.null_block
        assert null is not None
        gone = [b for b in table[:dead] if b is not null]
        if gone:
            self.block_pool.free_blocks(gone)
            self.num_dead_blocks_freed += len(gone)
        for i in range(min(dead, len(table))):
            table[i] = null
        table.extend([null] * (dead - len(table)))

    def num_blocks_to_admit(self, plans: list[tuple[SequenceState, PrefixHits, int]]) -> int:
        """Free blocks that admitting these (sequence, prefix hits, new tokens) together takes:
        fresh blocks beyond the hits, plus the distinct hits that sit in the free queue."""
        fresh = 0
        hits_from_free: set[int] = set()
        B = self.block_size
        for seq, hits, num_new in plans:
            group_hits = hits if self.is_hybrid else ([hits] if hits else [])
            start = seq.num_computed_tokens + self._num_hit_blocks(hits) * B
            needed = self.num_blocks_needed(start + num_new)
            for g, group in enumerate(self.groups):
                held = len(group_hits[g]) if group_hits else 0
                dead = min(group.num_dead_blocks(start, B), needed)
                fresh += max(0, needed - max(held, dead))
                if group_hits:
                    hits_from_free.update(b.block_id for b in group_hits[g]
                                          if b is not self.null_block and b.ref_count == 0)
        return fresh + len(hits_from_free)

    def max_blocks_per_sequence(self, num_tokens: int) -> int:
        """Pool blocks one decoding sequence of `num_tokens` holds at most, over all groups."""
        return sum(g.max_live_blocks(num_tokens, self.block_size) for g in self.groups)

    def fork(self, parent: SequenceState, child: SequenceState) -> None:
        """Share all of the parent's blocks with the child (copy-on-write on first write)."""
        if any(child.seq_id in t for t in self.tables):
            raise ValueError(f"seq {child.seq_id} already has a block table")
        for tables in self.tables:
            table = list(tables.get(parent.seq_id, ()))
            self.block_pool.touch(self._live(table))
            tables[child.seq_id] = table
        if parent.seq_id in self.req_to_block_hashes:
            self.req_to_block_hashes[child.seq_id] = list(self.req_to_block_hashes[parent.seq_id])

    def free(self, seq: SequenceState) -> None:
        """Release the sequence's blocks, tail first so its prefix stays cached the longest.

        A copy-on-write queued this step into one of its blocks is dropped: the block may be
        handed out again in the same step, and two copies into one block would race.
        """
        self._forget_table(seq.seq_id)
        self.req_to_block_hashes.pop(seq.seq_id, None)
        freed = False
        for tables, host_tables in zip(self.tables, self.host_tables):
            host_table = host_tables.pop(seq.seq_id, None)
            if host_table:
                assert self.host_pool is not None
                self.host_pool.free_blocks(reversed(self._live(host_table)))
            table = tables.pop(seq.seq_id, None)
            if table:
                self.block_pool.free_blocks(reversed(self._live(table)))
                freed = True
        if freed and self._pending_copies:
            blocks = self.block_pool.blocks
            self._pending_copies = [
                (src, dst) for src, dst in self._pending_copies if blocks[dst].ref_count > 0
            ]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src_block_id, dst_block_id) copies the runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies
