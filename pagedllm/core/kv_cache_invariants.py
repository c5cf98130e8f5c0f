"""The KV cache manager's bookkeeping checked whole: ref counts, tables, hashes, free queues.

Called by tests (and the random scheduler runs of tests/unit/core_sim.py) after every step,
never on the serving path; apart from the manager because it reads everything and changes
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.kv_block_tables import KVBlockTables
from pagedllm.core.request import SequenceState


class KVCacheInvariants(KVBlockTables):
    """`check_invariants`: raise AssertionError on the first inconsistency."""

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
