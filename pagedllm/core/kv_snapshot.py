"""A compact picture of the memory manager at one step boundary: block states and block tables.

Made only when someone asks (the dashboard's poll, `LLM.engine_state()`, `kv_map`), never on
the step path: the core runs it between two steps, so no table changes while it reads. The
cost is one pass over the block tables of live sequences and the prefix cache's map (not a
Python walk over the whole pool: the state array starts as "free" and only the blocks that are
something else are written), then a run-length encoding of the state array, which is what
crosses the process boundary (a pool of thousands of mostly free or mostly used blocks is a
few dozen runs).

Block states (one byte per block, `BLOCK_STATES` names them):
  0 free: ref count 0, no prefix hash: taken next by nothing in particular
  1 used: held by one sequence's table
  2 shared: held more than once (n > 1 or beam forks, prefix hits on a live block)
  3 cached: ref count 0 but still hashed: an evictable prefix-cache block (a later prompt with
    the same prefix hits it; an allocation that reaches it in the LRU queue evicts it)
  4 reserved: the null block of sliding-window tables (never freed)
  5 swapped: a host-pool block holding a swapped-out sequence's KV (host array only)

This module imports no torch (core/ rule).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState

FREE, USED, SHARED, CACHED, RESERVED, SWAPPED = range(6)
BLOCK_STATES = ("free", "used", "shared", "cached", "reserved", "swapped")
NO_GROUP = 255  # the group byte of a block no table holds


def rle_encode(data: bytes | bytearray) -> list[int]:
    """[value, run length, value, run length, ...]: flat, so it is plain JSON."""
    out: list[int] = []
    if not data:
        return out
    prev, run = data[0], 0
    for value in data:
        if value == prev:
            run += 1
        else:
            out += (prev, run)
            prev, run = value, 1
    out += (prev, run)
    return out


def rle_decode(runs: Iterable[int]) -> bytearray:
    """The inverse of `rle_encode`."""
    it = iter(runs)
    out = bytearray()
    for value in it:
        out += bytes((value,)) * next(it)
    return out


def _mark_tables(states: bytearray, groups: bytearray | None,
                 tables: Iterable[list[KVBlock]], null: KVBlock | None, used: int) -> None:
    for table in tables:
        for block in table:
            if block is null:
                continue
            states[block.block_id] = SHARED if block.ref_count > 1 else used
            if groups is not None:
                groups[block.block_id] = block.group


def block_states(kv: KVCacheManager) -> tuple[bytearray, bytearray | None]:
    """(state per device block, KV cache group per block or None when there is one group)."""
    pool: BlockPool = kv.block_pool
    states = bytearray(pool.num_blocks)  # FREE
    for block in pool.cached_block_hash_to_block.values():
        if block.ref_count == 0:
            states[block.block_id] = CACHED
    groups = bytearray([NO_GROUP]) * pool.num_blocks if len(kv.groups) > 1 else None
    for g, tables in enumerate(kv.tables):
        _mark_tables(states, groups, tables.values(), kv.null_block, USED)
    if kv.null_block is not None:
        states[kv.null_block.block_id] = RESERVED
    return states, groups


def host_block_states(kv: KVCacheManager) -> bytearray:
    """State per host (swap) block: free, or swapped (held by a swapped-out table)."""
    if kv.host_pool is None:
        return bytearray()
    states = bytearray(kv.host_pool.num_blocks)
    for tables in kv.host_tables:
        _mark_tables(states, None, tables.values(), kv.null_block, SWAPPED)
    for i, s in enumerate(states):
        if s == SHARED:
            states[i] = SWAPPED  # sharing on the host is not drawn apart
    return states


def count_states(states: bytes | bytearray, n: int = len(BLOCK_STATES)) -> dict[str, int]:
    return {BLOCK_STATES[v]: states.count(v) for v in range(n)}


def sequence_entry(seq: SequenceState, kv: KVCacheManager) -> dict[str, Any]:
    """One sequence: its status, tokens and block table(s) (device, or host while swapped)."""
    swapped = any(seq.seq_id in t for t in kv.host_tables)
    which = kv.host_tables if swapped else kv.tables
    null = kv.null_block
    tables = [[-1 if b is null else b.block_id for b in t.get(seq.seq_id, ())] for t in which]
    return {
        "seq_id": seq.seq_id,
        "index": seq.index,
        "status": seq.status.value,
        "num_prompt_tokens": len(seq.prompt_token_ids),
        "num_output_tokens": len(seq.output_token_ids),
        "num_computed_tokens": seq.num_computed_tokens,
        "num_preemptions": seq.num_preemptions,
        "on_host": swapped,
        "block_tables": tables,  # one per KV cache group; -1: a sliding table's dead entry
    }
