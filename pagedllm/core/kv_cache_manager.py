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
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.request import Sequence


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be non-negative, got {num_host_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Host memory for swapped-out blocks: ref counts and a free queue, never hashed.
        self.host_pool = BlockPool(num_host_blocks, False) if num_host_blocks else None
        self.req_to_blocks: dict[int, list[KVBlock]] = {}
        self.swapped_tables: dict[int, list[KVBlock]] = {}  # seq_id -> host blocks
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
        # seq_id -> how many leading ids of its table the runner holds unchanged
        self._synced: dict[int, int] = {}
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
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(seq_id, ())]

    # ---- what the runner's copy of the tables needs ---------------------------------------

    def take_table_delta(self, seq_id: int) -> tuple[int, list[int]]:
        """(start, ids): the runner's table of `seq_id` becomes its first `start` ids followed by
        `ids` (start 0: a new table). Usually one new block or nothing; the runner then holds the
        whole table."""
        table = self.req_to_blocks.get(seq_id, ())
        start = self._synced.get(seq_id, 0)
        self._synced[seq_id] = len(table)
        return start, [b.block_id for b in table[start:]]

    def take_released(self) -> list[int]:
        """Sequences whose tables are gone since the last call: the runner drops its copies."""
        out, self._released = self._released, []
        return out

    def _forget_table(self, seq_id: int) -> None:
        if self._synced.pop(seq_id, None) is not None:
            self._released.append(seq_id)

    # ---- prefix cache ---------------------------------------------------------------------

    def _block_hash(
        self, seq: Sequence, index: int, parent_hash: BlockHash | None
    ) -> BlockHash:
        start = index * self.block_size
        tokens = seq.token_ids_slice(start, start + self.block_size)
        # The salt and the long-context regime key the first block only: every later hash
        # chains from it.
        extra = None
        if index == 0 and (seq.cache_salt is not None or seq.long_context):
            extra = (seq.cache_salt,) + (("long-context",) if seq.long_context else ())
        return hash_block_tokens(parent_hash, tokens, extra)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of `seq`, and the tokens they hold.

        Only the first `num_tokens - 1` tokens are looked up: the last one is always recomputed
        because its logits are needed. Takes no references and counts nothing: the hit and
        query counters move when `allocate_slots` admits the sequence, so that a sequence
        looked up in several steps before it fits is counted once.
        """
        if not self._uses_prefix_cache(seq):
            return [], 0
        blocks: list[KVBlock] = []
        parent: BlockHash | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            parent = self._block_hash(seq, i, parent)
            block = self.block_pool.get_cached_block(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _uses_prefix_cache(self, seq: Sequence) -> bool:
        return self.enable_caching and seq.num_computed_tokens == 0 and not seq.skip_prefix_cache

    def first_missed_block_hash(
        self, seq: Sequence, hits: list[KVBlock]
    ) -> BlockHash | None:
        """Hash of the first looked-up block after `hits` (the block that missed), or None.

        The scheduler defers a waiting sequence whose missed block another sequence is
        computing in the same step: one step later it hits instead of computing it again.
        """
        if not self._uses_prefix_cache(seq):
            return None
        if len(hits) >= (seq.num_tokens - 1) // self.block_size:
            return None
        return self._block_hash(seq, len(hits), hits[-1].block_hash if hits else None)

    def hashes_filled_by(self, seq: Sequence, num_new_tokens: int) -> list[BlockHash]:
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

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash and publish every block now full of computed tokens (prompt or generated)."""
        if not self.enable_caching:
            return
        table = self.req_to_blocks.get(seq.seq_id)
        if table is None:
            return
        hashes = self.req_to_block_hashes.setdefault(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        for i in range(len(hashes), num_full):
            block_hash = self._block_hash(seq, i, hashes[-1] if hashes else None)
            hashes.append(block_hash)
            self.block_pool.cache_full_block(table[i], block_hash)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> bool:
        """Make the table cover this step's tokens; False (nothing changed) if the pool is short.

        Covers `num_computed_tokens + len(new_computed_blocks) * block_size + num_new_tokens`
        tokens. Prefix hits go first in an empty table (the caller then advances
        `num_computed_tokens`). A shared block in this step's write range is copied first
        (copy-on-write); the copy is queued for `take_pending_copies`.
        """
        hits = new_computed_blocks or []
        table = self.req_to_blocks.get(seq.seq_id, [])
        if table and not hits:  # the common decode step: the table covers it, nothing shared
            B = self.block_size
            first = seq.num_computed_tokens // B
            needed = -(-(seq.num_computed_tokens + num_new_tokens) // B)
            if needed <= len(table) and all(b.ref_count == 1 for b in table[first:needed]):
                return True
        if hits and table:
            raise ValueError(f"seq {seq.seq_id}: prefix hits given for a non-empty block table")
        hit_hashes = self._check_hits(seq, hits)
        B = self.block_size
        write_start = seq.num_computed_tokens + len(hits) * B
        write_end = write_start + num_new_tokens
        num_required = self.num_blocks_needed(write_end)
        num_new_blocks = max(0, num_required - len(table) - len(hits))
        cow = [
            i
            for i in range(write_start // B, min(len(table), num_required))
            if table[i].ref_count > 1
        ]
        # Capacity first: cached hits that sit in the free queue stop being free when touched.
        num_hits_from_free = sum(1 for b in hits if b.ref_count == 0)
        if num_new_blocks + len(cow) > self.block_pool.num_free_blocks - num_hits_from_free:
            return False

        if not table and self._uses_prefix_cache(seq):  # admission: count the lookup once
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(hits) * B
        if hits:
            self.block_pool.touch(hits)
            table = list(hits)
            self.req_to_block_hashes[seq.seq_id] = hit_hashes
        if cow and self._synced.get(seq.seq_id, 0) > cow[0]:
            self._synced[seq.seq_id] = cow[0]  # the runner's copy is stale from there
        for i, new_block in zip(cow, self.block_pool.get_new_blocks(len(cow))):
            old_block = table[i]
            table[i] = new_block
            self._pending_copies.append((old_block.block_id, new_block.block_id))
            self.block_pool.free_blocks([old_block])  # still held by its other owners
        table.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self.req_to_blocks[seq.seq_id] = table
        return True

    def num_blocks_to_admit(self, plans: list[tuple[Sequence, list[KVBlock], int]]) -> int:
        """Free blocks that admitting these (sequence, prefix hits, new tokens) together takes:
        fresh blocks beyond the hits, plus the distinct hits that sit in the free queue."""
        fresh = 0
        hits_from_free: set[int] = set()
        for seq, hits, num_new in plans:
            end = seq.num_computed_tokens + len(hits) * self.block_size + num_new
            fresh += max(0, self.num_blocks_needed(end) - len(hits))
            hits_from_free.update(b.block_id for b in hits if b.ref_count == 0)
        return fresh + len(hits_from_free)

    def _check_hits(self, seq: Sequence, hits: list[KVBlock]) -> list[BlockHash]:
        """Chain hashes of `hits`, refusing blocks evicted (and maybe reused) since the lookup."""
        hashes: list[BlockHash] = []
        for i, block in enumerate(hits):
            hashes.append(self._block_hash(seq, i, hashes[-1] if hashes else None))
            if block.block_hash != hashes[-1]:
                raise ValueError(f"seq {seq.seq_id}: stale prefix hit on block {block.block_id}")
        return hashes

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of the parent's blocks with the child (copy-on-write on first write)."""
        if child.seq_id in self.req_to_blocks:
            raise ValueError(f"seq {child.seq_id} already has a block table")
        table = list(self.req_to_blocks.get(parent.seq_id, ()))
        self.block_pool.touch(table)
        self.req_to_blocks[child.seq_id] = table
        if parent.seq_id in self.req_to_block_hashes:
            self.req_to_block_hashes[child.seq_id] = list(self.req_to_block_hashes[parent.seq_id])

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first so its prefix stays cached the longest.

        A copy-on-write queued this step into one of its blocks is dropped: the block may be
        handed out again in the same step, and two copies into one block would race.
        """
        table = self.req_to_blocks.pop(seq.seq_id, None)
        self._forget_table(seq.seq_id)
        self.req_to_block_hashes.pop(seq.seq_id, None)
        host_table = self.swapped_tables.pop(seq.seq_id, None)
        if host_table:
            assert self.host_pool is not None
            self.host_pool.free_blocks(reversed(host_table))
        if table:
            self.block_pool.free_blocks(reversed(table))
            if self._pending_copies:
                blocks = self.block_pool.blocks
                self._pending_copies = [
                    (src, dst) for src, dst in self._pending_copies if blocks[dst].ref_count > 0
                ]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src_block_id, dst_block_id) copies the runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- swap -----------------------------------------------------------------------------

    @staticmethod
    def _distinct(tables: Iterable[list[KVBlock]]) -> list[KVBlock]:
        seen: dict[int, KVBlock] = {}
        for table in tables:
            for block in table:
                seen.setdefault(block.block_id, block)
        return list(seen.values())

    def num_swap_out_blocks(self, seqs: list[Sequence]) -> int:
        """Host blocks a swap-out of `seqs` takes: each block they share is stored once."""
        return len(self._distinct(self.req_to_blocks.get(s.seq_id, []) for s in seqs))

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return (
            self.host_pool is not None
            and self.num_swap_out_blocks(seqs) <= self.host_pool.num_free_blocks
        )

    def num_swap_in_blocks(self, seqs: list[Sequence]) -> int:
        return len(self._distinct(self.swapped_tables.get(s.seq_id, []) for s in seqs))

    def swap_out(self, seqs: list[Sequence]) -> None:
        """Move the blocks of `seqs` (a forked group) to host memory, keeping their sharing.

        Each distinct device block gets one host block, whose ref count is the number of
        table entries that point at it; the device blocks lose those references (a block also
        held outside the group, e.g. a prefix hit, stays on the device for its other owners).
        A block filled by a copy-on-write queued this step holds nothing yet: the swap-out
        reads that copy's source instead, and the copy is dropped.
        """
        if not self.can_swap_out(seqs):
            raise ValueError("not enough free host blocks to swap out")
        assert self.host_pool is not None
        tables = [self.req_to_blocks.get(s.seq_id, []) for s in seqs]
        distinct = self._distinct(tables)
        host_blocks = self.host_pool.get_new_blocks(len(distinct))
        to_host = {d.block_id: h for d, h in zip(distinct, host_blocks)}
        cow_source = {dst: src for src, dst in self._pending_copies}
        self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in to_host]
        for d, h in zip(distinct, host_blocks):
            self._pending_swap_out.append((cow_source.get(d.block_id, d.block_id), h.block_id))
        self.num_swapped_out += len(distinct)
        host_refs: dict[int, int] = {}
        for seq, table in zip(seqs, tables):
            self.swapped_tables[seq.seq_id] = [to_host[b.block_id] for b in table]
            for b in table:
                host_refs[b.block_id] = host_refs.get(b.block_id, 0) + 1
            self.req_to_blocks.pop(seq.seq_id, None)
            self._forget_table(seq.seq_id)
            self.block_pool.free_blocks(reversed(table))
        for block_id, n in host_refs.items():  # get_new_blocks gave each host block one ref
            self.host_pool.touch([to_host[block_id]] * (n - 1))

    def swap_in(self, seqs: list[Sequence]) -> bool:
        """Bring swapped `seqs` back into fresh device blocks; False (nothing changed) if the
        pool is short. Their full blocks are published to the prefix cache again."""
        assert self.host_pool is not None
        tables = [self.swapped_tables.get(s.seq_id, []) for s in seqs]
        distinct = self._distinct(tables)
        if len(distinct) > self.block_pool.num_free_blocks:
            return False
        dev_blocks = self.block_pool.get_new_blocks(len(distinct))
        to_dev = {h.block_id: d for h, d in zip(distinct, dev_blocks)}
        self._pending_swap_in.extend((h.block_id, d.block_id) for h, d in zip(distinct, dev_blocks))
        self.num_swapped_in += len(distinct)
        dev_refs: dict[int, int] = {}
        for seq, table in zip(seqs, tables):
            dev_table = [to_dev[h.block_id] for h in table]
            self.req_to_blocks[seq.seq_id] = dev_table
            for h in table:
                dev_refs[h.block_id] = dev_refs.get(h.block_id, 0) + 1
            del self.swapped_tables[seq.seq_id]
            self.host_pool.free_blocks(reversed(table))
        for block_id, n in dev_refs.items():
            self.block_pool.touch([to_dev[block_id]] * (n - 1))
        for seq in seqs:
            table = self.req_to_blocks[seq.seq_id]
            for block, block_hash in zip(table, self.req_to_block_hashes.get(seq.seq_id, [])):
                self.block_pool.cache_full_block(block, block_hash)
        return True

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-out (device, host) pairs, swap-in (host, device) pairs) queued this step."""
        out, self._pending_swap_out = self._pending_swap_out, []
        inn, self._pending_swap_in = self._pending_swap_in, []
        return out, inn

    # ---- checks for tests -----------------------------------------------------------------

    def check_invariants(self, active_seqs: Iterable[Sequence]) -> None:
        """Assert the bookkeeping is consistent; raises AssertionError on the first breach."""
        seqs = {s.seq_id: s for s in active_seqs}
        B = self.block_size
        assert set(self.req_to_blocks) <= set(seqs), "block table of an inactive sequence"
        assert set(self.swapped_tables) <= set(seqs), "host table of an inactive sequence"
        assert not set(self.req_to_blocks) & set(self.swapped_tables), "on device and host"
        self._check_host_pool()
        refs: dict[int, int] = {}
        for seq_id, table in self.req_to_blocks.items():
            seq = seqs[seq_id]
            assert len(table) >= self.num_blocks_needed(seq.num_computed_tokens)
            assert len(table) <= self.num_blocks_needed(seq.num_tokens)
            hashes = self.req_to_block_hashes.get(seq_id, [])
            assert len(hashes) <= seq.num_computed_tokens // B
            for i, block in enumerate(table):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                if block.block_hash is not None:  # a hashed block lies wholly in computed range
                    assert (i + 1) * B <= seq.num_computed_tokens, (seq_id, i, block)
        pool = self.block_pool
        for block in pool.blocks:  # invariant 2, per block (so also in sum)
            assert block.ref_count == refs.get(block.block_id, 0), block
        free = list(pool.free_block_queue)
        assert len(free) == len(pool.free_block_queue)
        assert len({b.block_id for b in free}) == len(free)
        assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_count == 0}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_block_hash_to_block)
        if not self.enable_caching:
            assert not hashed and not self.req_to_block_hashes

    def _check_host_pool(self) -> None:
        if self.host_pool is None:
            assert not self.swapped_tables
            return
        refs: dict[int, int] = {}
        for table in self.swapped_tables.values():
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.host_pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), block
            assert block.block_hash is None
        free = {b.block_id for b in self.host_pool.free_block_queue}
        assert free == {b.block_id for b in self.host_pool.blocks if b.ref_count == 0}
