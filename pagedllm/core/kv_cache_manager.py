"""Per-sequence block tables on top of the BlockPool: allocation, prefix hits, fork, CoW, free.

A sequence's block table maps its positions to physical blocks:
`slot(pos) = table[pos // block_size] * block_size + pos % block_size`. Blocks are shared in two
ways: prefix-cache hits on full, hashed blocks (never written again), and `fork` (n > 1, beam
search), whose partly filled last block is copied on the first write (copy-on-write).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.request import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[int, list[KVBlock]] = {}
        # Chain hashes of each sequence's full computed blocks, in order (the next block's
        # parent); kept even where the pool holds a duplicate and did not cache the block.
        self.req_to_block_hashes: dict[int, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

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
        return sum(1 for b in self.block_pool.blocks if b.ref_count > 1)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(seq_id, ())]

    # ---- prefix cache ---------------------------------------------------------------------

    def _block_hash(self, seq: Sequence, index: int, parent_hash: int | None) -> int:
        start = index * self.block_size
        tokens = seq.token_ids_slice(start, start + self.block_size)
        # The salt keys the first block only: every later hash chains from it.
        extra = (seq.cache_salt,) if index == 0 and seq.cache_salt is not None else None
        return hash_block_tokens(parent_hash, tokens, extra)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of `seq`, and the tokens they hold.

        Only the first `num_tokens - 1` tokens are looked up: the last one is always recomputed
        because its logits are needed. Takes no references (see `allocate_slots`).
        """
        if not self.enable_caching or seq.num_computed_tokens > 0 or seq.skip_prefix_cache:
            return [], 0
        blocks: list[KVBlock] = []
        parent: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            parent = self._block_hash(seq, i, parent)
            block = self.block_pool.get_cached_block(parent)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

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

        if hits:
            self.block_pool.touch(hits)
            table = list(hits)
            self.req_to_block_hashes[seq.seq_id] = hit_hashes
        for i, new_block in zip(cow, self.block_pool.get_new_blocks(len(cow))):
            old_block = table[i]
            table[i] = new_block
            self._pending_copies.append((old_block.block_id, new_block.block_id))
            self.block_pool.free_blocks([old_block])  # still held by its other owners
        table.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self.req_to_blocks[seq.seq_id] = table
        return True

    def _check_hits(self, seq: Sequence, hits: list[KVBlock]) -> list[int]:
        """Chain hashes of `hits`, refusing blocks evicted (and maybe reused) since the lookup."""
        hashes: list[int] = []
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
        """Release the sequence's blocks, tail first so its prefix stays cached the longest."""
        table = self.req_to_blocks.pop(seq.seq_id, None)
        self.req_to_block_hashes.pop(seq.seq_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src_block_id, dst_block_id) copies the runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- checks for tests -----------------------------------------------------------------

    def check_invariants(self, active_seqs: Iterable[Sequence]) -> None:
        """Assert the bookkeeping is consistent; raises AssertionError on the first breach."""
        seqs = {s.seq_id: s for s in active_seqs}
        B = self.block_size
        assert set(self.req_to_blocks) <= set(seqs), "block table of an inactive sequence"
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
