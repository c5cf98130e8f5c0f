"""Swap preemption's side of the KV cache: a group's blocks to host memory and back.

The host pool is a second BlockPool without caching; the manager remaps the block tables
(keeping the group's sharing: each distinct block is stored once) and queues the (src, dst)
copies that the cache engine performs before the next forward, swap-out before swap-in before
copy-on-write. Apart from allocation because it moves whole tables between pools rather than
growing them.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_block_tables import KVBlockTables
from pagedllm.core.request import SequenceState


class KVCacheSwap(KVBlockTables):
    """Swap out / in of a group's tables and the copies that carry it out."""

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
