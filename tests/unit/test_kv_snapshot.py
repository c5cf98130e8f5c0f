"""core/kv_snapshot.py on toy pools: block states (free / used / shared / cached / reserved /
swapped) with exact block ids, the run-length encoding, and the cost of a snapshot of a big pool."""

from __future__ import annotations

import time

from pagedllm.core.kv_cache_groups import KVCacheGroup, KVCacheGroups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_snapshot import (
    BLOCK_STATES,
    block_states,
    count_states,
    host_block_states,
    rle_decode,
    rle_encode,
    sequence_entry,
)
from tests.unit.test_kv_cache_manager import make_seq, run

F, U, S, C, R, W = range(6)


def test_states_with_exact_ids_fork_cache_and_swap():
    kv = KVCacheManager(num_blocks=12, block_size=4, num_host_blocks=6)
    a = make_seq(range(10))  # blocks 0, 1, 2 (two full, hashed)
    assert run(kv, a) == [0, 1, 2]
    b = make_seq(range(10), ())
    kv.fork(a, b)  # shares 0, 1, 2
    states, groups = block_states(kv)
    assert groups is None
    assert list(states) == [S, S, S] + [F] * 9
    done = make_seq(range(100, 109))  # 3 blocks, then freed: 3, 4 stay cached, 5 was partial
    assert run(kv, done) == [3, 4, 5]
    kv.free(done)
    states, _ = block_states(kv)
    assert list(states) == [S, S, S, C, C, F] + [F] * 6
    kv.swap_out([a, b])  # the forked pair to the host: 3 host blocks, shared there
    states, _ = block_states(kv)
    assert list(states[:3]) == [C, C, F]  # a's two full blocks stay cached on the device
    host = host_block_states(kv)
    assert list(host) == [W, W, W, F, F, F]
    assert sequence_entry(a, kv)["on_host"] and sequence_entry(a, kv)["block_tables"] == [[0, 1, 2]]
    counts = count_states(states)
    assert counts == {"free": 8, "used": 0, "shared": 0, "cached": 4, "reserved": 0, "swapped": 0}
    assert rle_decode(rle_encode(states)) == states


def test_sliding_null_block_is_reserved_and_groups_are_reported():
    groups = KVCacheGroups((KVCacheGroup((0,), None), KVCacheGroup((1,), 8)), 1)
    kv = KVCacheManager(num_blocks=10, block_size=4, groups=groups)
    seq = make_seq(range(6))
    run(kv, seq)
    states, owner = block_states(kv)
    assert states[kv.null_block.block_id] == R
    assert owner is not None and owner[kv.null_block.block_id] == 255
    used = [i for i, s in enumerate(states) if s == U]
    assert sorted(owner[i] for i in used) == [0, 0, 1, 1]  # two blocks in each group's table
    entry = sequence_entry(seq, kv)
    assert len(entry["block_tables"]) == 2


def test_snapshot_of_a_big_pool_is_cheap_and_compact():
    """8192 blocks, 64 sequences of 1000 tokens sharing a 512-token prefix: the block walk and
    the encoding stay a few milliseconds (made only when asked, at most 4 times a second)."""
    kv = KVCacheManager(num_blocks=8192, block_size=16)
    prefix = list(range(512))
    seqs = [make_seq(prefix + list(range(10_000 + 1000 * i, 10_000 + 1000 * i + 488)))
            for i in range(64)]
    for s in seqs:
        run(kv, s)
    t0 = time.perf_counter()
    states, _ = block_states(kv)
    runs = rle_encode(states)
    entries = [sequence_entry(s, kv) for s in seqs]
    elapsed = time.perf_counter() - t0
    counts = count_states(states)
    assert counts["shared"] == 32 and counts["used"] == 64 * 31  # 63 blocks each, 32 shared
    assert counts["used"] + counts["shared"] == kv.num_blocks - kv.num_free_blocks
    assert len(runs) < 20 and len(entries) == 64
    assert elapsed < 0.1, elapsed  # measured ~4 ms; generous for a loaded machine
    assert BLOCK_STATES[states[0]] == "shared"
