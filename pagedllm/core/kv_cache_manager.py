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
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.kv_cache_groups import KVCacheGroup, KVCacheGroups
from pagedllm.core.request import SequenceState

# Prefix hits: one list of blocks (one group), or one list per group (hybrid).
PrefixHits = list


class KVCacheManager:
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

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    # ---- prefix cache ---------------------------------------------------------------------

    def _block_hash(
        self, seq: SequenceState, index: int, parent_hash: BlockHash | None
    ) -> BlockHash:
        start = index * self.block_size
        tokens = seq.token_ids_slice(start, start + self.block_size)
        # The salt, the long-context regime and the LoRA adapter key the first block only:
        # every later hash chains from it.
        extra = None
        if index == 0 and (seq.cache_salt is not None or seq.long_context or seq.lora_key is not None):
            extra = ((seq.cache_salt,) + (("long-context",) if seq.long_context else ())
                     + (("lora", seq.lora_key) if seq.lora_key is not None else ()))
        return hash_block_tokens(parent_hash, tokens, extra)

    @staticmethod
    def _group_key(group: int, block_hash: BlockHash) -> BlockHash:
        """The pool's key of a block of `group` (group 0: the chain hash itself, as always)."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def get_computed_blocks(self, seq: SequenceState) -> tuple[PrefixHits, int]:
        """Longest run of cached full blocks at the start of `seq`, and the tokens they hold.

        Only the first `num_tokens - 1` tokens are looked up: the last one is always recomputed
        because its logits are needed. Takes no references and counts nothing: the hit and
        query counters move when `allocate_slots` admits the sequence, so that a sequence
        looked up in several steps before it fits is counted once. Hybrid: one list per group
        (a sliding group's dead positions null), or [] when nothing hits.
        """
        if not self._uses_prefix_cache(seq):
            return [], 0
        if not self.is_hybrid:
            blocks: list[KVBlock] = []
            parent: BlockHash | None = None
            for i in range((seq.num_tokens - 1) // self.block_size):
                parent = self._block_hash(seq, i, parent)
                block = self.block_pool.get_cached_block(parent)
                if block is None:
                    break
                blocks.append(block)
            return blocks, len(blocks) * self.block_size
        hashes: list[BlockHash] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            hashes.append(self._block_hash(seq, i, hashes[-1] if hashes else None))
        cached = [[self.block_pool.get_cached_block(self._group_key(g, h)) for h in hashes]
                  for g in range(len(self.groups))]
        length = len(hashes)
        changed = True
        while changed and length > 0:  # each group lowers the length it cannot serve
            changed = False
            for g, group in enumerate(self.groups):
                served = self._servable_length(group, cached[g], length)
                if served < length:
                    length, changed = served, True
        if length == 0:
            return [], 0
        B = self.block_size
        hits = []
        for g, group in enumerate(self.groups):
            dead = group.num_dead_blocks(length * B, B)
            hits.append([self.null_block] * dead + cached[g][dead:length])
        return hits, length * B

    def _servable_length(self, group: KVCacheGroup, cached: list[KVBlock | None],
                         length: int) -> int:
        """The longest hit <= `length` blocks this group can give: a full group its leading
        cached run; a sliding group an end h whose window's blocks are all cached."""
        if not group.is_sliding:
            n = 0
            while n < length and cached[n] is not None:
                n += 1
            return n
        B = self.block_size
        for h in range(length, 0, -1):
            dead = group.num_dead_blocks(h * B, B)
            if all(b is not None for b in cached[dead:h]):
                return h
        return 0

    def _uses_prefix_cache(self, seq: SequenceState) -> bool:
        return self.enable_caching and seq.num_computed_tokens == 0 and not seq.skip_prefix_cache

    def first_missed_block_hash(
        self, seq: SequenceState, hits: PrefixHits
    ) -> BlockHash | None:
        """Hash of the first looked-up block after `hits` (the block that missed), or None.

        The scheduler defers a waiting sequence whose missed block another sequence is
        computing in the same step: one step later it hits instead of computing it again.
        """
        if not self._uses_prefix_cache(seq):
            return None
        n = self._num_hit_blocks(hits)
        if n >= (seq.num_tokens - 1) // self.block_size:
            return None
        parent = None
        for i in range(n + 1):
            parent = self._block_hash(seq, i, parent)
        return parent

    def _num_hit_blocks(self, hits: PrefixHits) -> int:
        if not hits:
            return 0
        return len(hits[0]) if self.is_hybrid else len(hits)

    def hashes_filled_by(self, seq: SequenceState, num_new_tokens: int) -> list[BlockHash]:
        """Chain hashes of the blocks that computing `num_new_tokens` more tokens makes full."""
        if not self.enable_caching or seq.skip_prefix_cache:
            return []
        hashes = self.req_to_block_hashes.get(seq.seq_id, [])
        parent = hashes[-1] if hashes else None
        out = []
        for i in range(len(hashes), (seq.num_computed_tokens + num_new_tokens) // self.block_size):
            parent = self._block_hash(seq, i, parent)
            out.append(parent)
        return out

    def cache_full_blocks(self, seq: SequenceState) -> None:
        """Hash and publish every block now full of computed tokens (prompt or generated)."""
        if not self.enable_caching:
            return
        table = self.req_to_blocks.get(seq.seq_id)
        if table is None:
            return
        hashes = self.req_to_block_hashes.setdefault(seq.seq_id, [])
        # Computed positions can run ahead of the known tokens while a step's accepted draft
        # tokens are not appended yet (speculative decoding): those blocks hash next time.
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(table))
        for i in range(len(hashes), num_full):
            block_hash = self._block_hash(seq, i, hashes[-1] if hashes else None)
            hashes.append(block_hash)
            for g, tables in enumerate(self.tables):
                block = tables[seq.seq_id][i]
                if block is not self.null_block:
                    self.block_pool.cache_full_block(block, self._group_key(g, block_hash))

    def reset_prefix_cache(self) -> bool:
        if self.null_block is None:
            return self.block_pool.reset_prefix_cache()
        if self.block_pool.num_used_blocks > 1:  # the null block is always held
            return False
        self.block_pool.cached_block_hash_to_block.clear()
        for block in self.block_pool.blocks:
            block.block_hash = None
        return True

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

    def _check_hits(self, seq: SequenceState, group_hits: list[list[KVBlock]]) -> list[BlockHash]:
        """Chain hashes of the hits, refusing blocks evicted (and maybe reused) since the lookup."""
        hashes: list[BlockHash] = []
        if not group_hits:
            return hashes
        for i in range(len(group_hits[0])):
            hashes.append(self._block_hash(seq, i, hashes[-1] if hashes else None))
        for g, blocks in enumerate(group_hits):
            for i, block in enumerate(blocks):
                if block is self.null_block:
                    continue
                if block.block_hash != self._group_key(g, hashes[i]):
                    raise ValueError(f"seq {seq.seq_id}: stale prefix hit on block {block.block_id}")
        return hashes

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

    # ---- swap -----------------------------------------------------------------------------

    def _distinct(self, tables: Iterable[list[KVBlock]]) -> list[KVBlock]:
        seen: dict[int, KVBlock] = {}
        null = self.null_block
        for table in tables:
            for block in table:
                if block is not null:
                    seen.setdefault(block.block_id, block)
        return list(seen.values())

    def _allocate_per_group(self, src: list[dict[int, list[KVBlock]]], seqs: list[SequenceState],
                            pool: BlockPool) -> tuple[list[KVBlock], list[KVBlock]]:
        """The distinct blocks of `seqs`' tables in `src`, and as many new blocks of `pool`,
        each taken for the group its source block serves."""
        distinct: list[KVBlock] = []
        new: list[KVBlock] = []
        for g, tables in enumerate(src):
            blocks = self._distinct(tables.get(s.seq_id, []) for s in seqs)
            distinct += blocks
            new += pool.get_new_blocks(len(blocks), g)
        return distinct, new

    def _all_tables(self, which: list[dict[int, list[KVBlock]]], seqs: list[SequenceState]):
        return [t.get(s.seq_id, []) for t in which for s in seqs]

    def num_swap_out_blocks(self, seqs: list[SequenceState]) -> int:
        """Host blocks a swap-out of `seqs` takes: each block they share is stored once, dead
        (null) entries not at all."""
        return len(self._distinct(self._all_tables(self.tables, seqs)))

    def can_swap_out(self, seqs: list[SequenceState]) -> bool:
        return (
            self.host_pool is not None
            and self.num_swap_out_blocks(seqs) <= self.host_pool.num_free_blocks
        )

    def num_swap_in_blocks(self, seqs: list[SequenceState]) -> int:
        return len(self._distinct(self._all_tables(self.host_tables, seqs)))

    def num_swapped_entries(self, seq: SequenceState) -> int:
        """Blocks of `seq` held on the host (all groups): what a swap-in brings back."""
        return sum(len(self._live(t.get(seq.seq_id, ()))) for t in self.host_tables)

    def swap_out(self, seqs: list[SequenceState]) -> None:
        """Move the blocks of `seqs` (a forked group) to host memory, keeping their sharing.

        Each distinct device block gets one host block, whose ref count is the number of
        table entries that point at it; the device blocks lose those references (a block also
        held outside the group, e.g. a prefix hit, stays on the device for its other owners).
        A block filled by a copy-on-write queued this step holds nothing yet: the swap-out
        reads that copy's source instead, and the copy is dropped. Null entries stay null.
        """
        if not self.can_swap_out(seqs):
            raise ValueError("not enough free host blocks to swap out")
        assert self.host_pool is not None
        distinct, host_blocks = self._allocate_per_group(self.tables, seqs, self.host_pool)
        to_host = {d.block_id: h for d, h in zip(distinct, host_blocks)}
        cow_source = {dst: src for src, dst in self._pending_copies}
        self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in to_host]
        for d, h in zip(distinct, host_blocks):
            self._pending_swap_out.append((cow_source.get(d.block_id, d.block_id), h.block_id))
        self.num_swapped_out += len(distinct)
        self._move_tables(seqs, self.tables, self.host_tables, self.block_pool, self.host_pool,
                          to_host)
        for seq in seqs:
            self._forget_table(seq.seq_id)

    def swap_in(self, seqs: list[SequenceState]) -> bool:
        """Bring swapped `seqs` back into fresh device blocks; False (nothing changed) if the
        pool is short. Their full blocks are published to the prefix cache again."""
        assert self.host_pool is not None
        null = self.null_block
        if self.num_swap_in_blocks(seqs) > self.block_pool.num_free_blocks:
            return False
        distinct, dev_blocks = self._allocate_per_group(self.host_tables, seqs, self.block_pool)
        to_dev = {h.block_id: d for h, d in zip(distinct, dev_blocks)}
        self._pending_swap_in.extend((h.block_id, d.block_id) for h, d in zip(distinct, dev_blocks))
        self.num_swapped_in += len(distinct)
        self._move_tables(seqs, self.host_tables, self.tables, self.host_pool, self.block_pool,
                          to_dev)
        for seq in seqs:
            hashes = self.req_to_block_hashes.get(seq.seq_id, [])
            for g, tables in enumerate(self.tables):
                for block, block_hash in zip(tables[seq.seq_id], hashes):
                    if block is not null:
                        self.block_pool.cache_full_block(block, self._group_key(g, block_hash))
        return True

    def _move_tables(self, seqs: list[SequenceState], src: list[dict[int, list[KVBlock]]],
                     dst: list[dict[int, list[KVBlock]]], src_pool: BlockPool,
                     dst_pool: BlockPool, mapping: dict[int, KVBlock]) -> None:
        """Re-point the tables of `seqs` (every group) from `src` to `dst` blocks by `mapping`,
        keeping their sharing: each destination block (one ref from get_new_blocks) takes one
        ref per table entry; the source blocks lose theirs. Null entries stay null."""
        null = self.null_block
        refs: dict[int, int] = {}
        for src_tables, dst_tables in zip(src, dst):
            for seq in seqs:
                table = src_tables.pop(seq.seq_id, [])
                dst_tables[seq.seq_id] = [b if b is null else mapping[b.block_id] for b in table]
                live = self._live(table)
                for b in live:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
                src_pool.free_blocks(reversed(live))
        for block_id, n in refs.items():
            dst_pool.touch([mapping[block_id]] * (n - 1))

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-out (device, host) pairs, swap-in (host, device) pairs) queued this step."""
        out, self._pending_swap_out = self._pending_swap_out, []
        inn, self._pending_swap_in = self._pending_swap_in, []
        return out, inn

    # ---- checks for tests -----------------------------------------------------------------

    def check_invariants(self, active_seqs: Iterable[SequenceState]) -> None:
        """Assert the bookkeeping is consistent; raises AssertionError on the first breach."""
        seqs = {s.seq_id: s for s in active_seqs}
        B = self.block_size
        null = self.null_block
        for tables, host_tables in zip(self.tables, self.host_tables):
            assert set(tables) <= set(seqs), "block table of an inactive sequence"
            assert set(host_tables) <= set(seqs), "host table of an inactive sequence"
            assert not set(tables) & set(host_tables), "on device and host"
            assert set(tables) == set(self.req_to_blocks), "a sequence lacks a group's table"
            assert set(host_tables) == set(self.swapped_tables), "a swapped sequence lacks a group"
        self._check_host_pool()
        refs: dict[int, int] = {} if null is None else {null.block_id: 1}
        for g, (group, tables) in enumerate(zip(self.groups, self.tables)):
            for seq_id, table in tables.items():
                seq = seqs[seq_id]
                assert len(table) >= self.num_blocks_needed(seq.num_computed_tokens)
                assert len(table) <= self.num_blocks_needed(seq.num_tokens)
                hashes = self.req_to_block_hashes.get(seq_id, [])
                assert len(hashes) <= seq.num_computed_tokens // B
                live_from = group.num_dead_blocks(seq.num_computed_tokens, B)
                for i, block in enumerate(table):
                    if block is null:  # only dead positions are null, and only when sliding
                        assert group.is_sliding and i < live_from, (g, seq_id, i)
                        continue
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                    if block.block_hash is not None:  # a hashed block lies wholly in computed range
                        assert (i + 1) * B <= seq.num_computed_tokens, (seq_id, i, block)
        pool = self.block_pool
        for block in pool.blocks:  # invariant 2, per block (so also in sum)
            assert block.ref_count == refs.get(block.block_id, 0), block
        for g, tables in enumerate(self.tables):  # a block serves one group; counts follow
            ids = {b.block_id for table in tables.values() for b in table if b is not null}
            assert all(pool.blocks[i].group == g for i in ids), ("block in another group", g)
        assert pool.num_used_by_group == [
            sum(1 for b in pool.blocks if b.ref_count and b.group == g)
            for g in range(len(self.groups))], ("per-group used counts", pool.num_used_by_group)
        free = list(pool.free_block_queue)  # freed after use; fresh blocks are not in `blocks`
        assert len(free) == len(pool.free_block_queue)
        assert len({b.block_id for b in free}) == len(free)
        assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_count == 0}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_block_hash_to_block)
        if null is not None:
            assert null.block_hash is None
        if not self.enable_caching:
            assert not hashed and not self.req_to_block_hashes

    def _check_host_pool(self) -> None:
        if self.host_pool is None:
            assert not any(self.host_tables)
            return
        refs: dict[int, int] = {}
        for host_tables in self.host_tables:
            for table in host_tables.values():
                for block in self._live(table):
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.host_pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), block
            assert block.block_hash is None
        free = {b.block_id for b in self.host_pool.free_block_queue}
        assert free == {b.block_id for b in self.host_pool.blocks if b.ref_count == 0}
