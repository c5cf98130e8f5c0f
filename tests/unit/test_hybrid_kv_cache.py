"""KVCacheManager with KV cache groups (core/, no model): a sliding group's table after each
step with exact block ids, the prefix-hit length with mixed groups, swap of live blocks only,
fork and copy-on-write per group. Random runs with groups: test_scheduler_liveness."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_groups import group_layers
from pagedllm.core.kv_cache_manager import KVCacheManager
from tests.unit.test_kv_cache_manager import make_seq, run

B = 4
W = 8  # a query at q reads keys q-7 .. q: two blocks of four, or three when it straddles


def hybrid(num_blocks=32, caching=True, host=0) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, caching, host, group_layers([None, W]))


def ids(kv, seq, g):
    return kv.get_block_ids(seq.seq_id, g)


def decode(kv, seq, token=7):
    seq.append_token(token)
    return run(kv, seq, 1)


def test_a_sliding_table_drops_blocks_behind_its_window_step_by_step():
    kv = hybrid()
    assert kv.null_block is not None and kv.null_block.block_id == 0
    seq = make_seq(range(10))
    run(kv, seq)  # prefill: 3 blocks in each group, nothing behind the window yet
    assert ids(kv, seq, 0) == [1, 2, 3] and ids(kv, seq, 1) == [4, 5, 6]
    decode(kv, seq)  # computes position 10 (c = 10): keys 3..10 are read, block 0 still
    assert ids(kv, seq, 1) == [4, 5, 6]
    decode(kv, seq)  # c = 11: keys 4.. -> block 0 (positions 0-3) is dead
    assert ids(kv, seq, 1) == [0, 5, 6] and kv.num_dead_blocks_freed == 1
    decode(kv, seq)  # c = 12: a new block in each group, from the free queue's head (block
    # 4 went to its tail: least recently freed blocks are reused first)
    assert ids(kv, seq, 0) == [1, 2, 3, 7] and ids(kv, seq, 1) == [0, 5, 6, 8]
    for _ in range(3):
        decode(kv, seq)
    assert seq.num_computed_tokens == 16  # c = 15 at the last allocation: keys 8.. live
    assert ids(kv, seq, 1) == [0, 0, 6, 8] and ids(kv, seq, 0) == [1, 2, 3, 7]
    kv.check_invariants([seq])
    # held: 4 full + 2 sliding + the null block; the freed ones are free again
    assert kv.num_free_blocks == 32 - 4 - 2 - 1
    kv.free(seq)
    assert kv.num_free_blocks == kv.num_usable_blocks == 31
    kv.check_invariants([])


def test_a_prefill_chunk_past_the_window_keeps_only_what_its_queries_read():
    kv = hybrid()
    seq = make_seq(range(30))
    run(kv, seq, 12)  # chunk 1: positions 0-11, all needed by its own queries
    assert ids(kv, seq, 1) == [4, 5, 6]
    run(kv, seq, 12)  # chunk 2 starts at 12: keys from 5 on -> block 0 dead
    assert ids(kv, seq, 0) == [1, 2, 3, 7, 8, 9] and ids(kv, seq, 1) == [0, 5, 6, 10, 11, 12]
    run(kv, seq, 6)  # chunk 3 starts at 24: keys from 17 on -> blocks 0-3 dead
    assert ids(kv, seq, 0) == [1, 2, 3, 7, 8, 9, 13, 14]
    assert ids(kv, seq, 1) == [0, 0, 0, 0, 11, 12, 15, 16]
    assert kv.num_dead_blocks_freed == 4
    kv.check_invariants([seq])


def _cached_prompt(kv, n):
    a = make_seq(range(100, 100 + n))
    run(kv, a)
    table = [list(kv.tables[g][a.seq_id]) for g in range(2)]
    kv.free(a)
    return table


def test_prefix_hit_is_the_longest_prefix_every_group_can_serve():
    kv = hybrid()
    full, sliding = _cached_prompt(kv, 20)  # 5 full blocks in each group, all cached
    b = make_seq(list(range(100, 120)) + [1])
    hits, n = kv.get_computed_blocks(b)
    assert n == 20
    assert [x.block_id for x in hits[0]] == [x.block_id for x in full]
    # the sliding group gives only what a query at 20 reads (keys 13..): blocks 3 and 4
    assert [x.block_id for x in hits[1]] == [0, 0, 0] + [x.block_id for x in sliding[3:5]]

    # a sliding block behind the window may be gone: the hit does not need it
    kv.block_pool._evict_cached_block(sliding[0])
    assert kv.get_computed_blocks(b)[1] == 20
    # one the window needs is gone: the hit ends where the window is whole again (16: 2..3)
    kv.block_pool._evict_cached_block(sliding[4])
    assert kv.get_computed_blocks(b)[1] == 16
    # 16 needs 2-3, 12 needs 1-2, 8 and 4 need block 0, evicted above: nothing is left
    kv.block_pool._evict_cached_block(sliding[2])
    assert kv.get_computed_blocks(b) == ([], 0)


def test_without_the_full_groups_first_block_nothing_hits():
    kv = hybrid()
    full, _ = _cached_prompt(kv, 20)
    kv.block_pool._evict_cached_block(full[0])
    assert kv.get_computed_blocks(make_seq(list(range(100, 120)) + [1])) == ([], 0)


def test_a_hit_admits_with_null_entries_and_counts_only_live_blocks():
    kv = hybrid()
    _cached_prompt(kv, 20)
    b = make_seq(list(range(100, 120)) + [1, 2])
    free_before = kv.num_free_blocks
    table = run(kv, b)
    assert b.num_computed_tokens == 22 and len(table) == 6
    assert ids(kv, b, 1)[:3] == [0, 0, 0]
    # the 5 full + 2 sliding hits leave the free queue; one new block per group for 20-21
    assert kv.num_free_blocks == free_before - 7 - 2
    kv.check_invariants([b])
    assert kv.prefix_cache_hits == 20


def test_group_hashes_never_cross_groups():
    kv = hybrid()
    _cached_prompt(kv, 8)
    keys = [k for k in kv.block_pool.cached_block_hash_to_block]
    assert len(keys) == 4 and len({k[:32] for k in keys}) == 2  # one chain, two groups' keys


def test_swap_moves_live_blocks_only_and_brings_the_nulls_back():
    kv = hybrid(host=16)
    seq = make_seq(range(20))
    run(kv, seq)
    for _ in range(3):
        decode(kv, seq)
    live = [i for i in ids(kv, seq, 1) if i != 0]
    num_full = len(ids(kv, seq, 0))
    assert len(live) < num_full == len(ids(kv, seq, 1))
    assert kv.num_swap_out_blocks([seq]) == num_full + len(live)
    kv.swap_out([seq])
    kv.check_invariants([seq])
    assert kv.num_free_host_blocks == 16 - num_full - len(live)
    assert kv.num_used_blocks_by_group == [0, 0]
    assert kv.host_pool.num_used_by_group == [num_full, len(live)]
    assert kv.swap_in([seq])
    kv.check_invariants([seq])
    assert kv.num_used_blocks_by_group == [num_full, len(live)]  # each back in its own group
    back = ids(kv, seq, 1)
    assert back[: len(back) - len(live)] == [0] * (len(back) - len(live))
    out, inn = kv.take_pending_swaps()
    assert len(out) == len(inn) == kv.num_swapped_out


def test_fork_shares_every_group_and_copies_on_write_per_group():
    kv = hybrid()
    parent = make_seq(range(14))
    run(kv, parent)
    child = make_seq(range(14))
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert ids(kv, child, 0) == ids(kv, parent, 0) and ids(kv, child, 1) == ids(kv, parent, 1)
    decode(kv, parent, 1)
    decode(kv, child, 2)
    copies = kv.take_pending_copies()
    assert len(copies) == 2  # the shared last block, once in each group, for the parent
    # full: 4 shared + 1 copy; sliding: its first block died (c = 14 reads keys 7..), 3 + 1
    assert kv.num_used_blocks_by_group == [4 + 1, 3 + 1]
    assert ids(kv, parent, 0)[-1] != ids(kv, child, 0)[-1]
    assert ids(kv, parent, 1)[-1] != ids(kv, child, 1)[-1]
    kv.check_invariants([parent, child])


def test_one_attention_type_is_the_manager_it_always_was():
    plain = KVCacheManager(16, B, True, 0)
    grouped = KVCacheManager(16, B, True, 0, group_layers([None] * 3))
    assert grouped.null_block is None and not grouped.is_hybrid
    tables = []
    for kv in (plain, grouped):
        s = make_seq(range(13))
        run(kv, s)
        decode(kv, s)
        tables.append(kv.get_block_ids(s.seq_id))
    assert tables[0] == tables[1] == [0, 1, 2, 3]
    assert plain.num_free_blocks == grouped.num_free_blocks == 12


def test_one_window_on_every_layer_is_one_sliding_group_that_drops_blocks():
    """Mistral / Phi-3-mini-4k: no second group, but the window still lets blocks go."""
    kv = KVCacheManager(16, B, True, 0, group_layers([W] * 3))
    assert kv.is_hybrid and len(kv.groups) == 1 and kv.null_block.block_id == 0
    seq = make_seq(range(10))
    run(kv, seq)
    assert ids(kv, seq, 0) == [1, 2, 3]
    decode(kv, seq)
    decode(kv, seq)  # c = 11: positions 0-3 are behind every query's window
    assert ids(kv, seq, 0) == [0, 2, 3] and kv.num_dead_blocks_freed == 1
    decode(kv, seq)  # c = 12: one new block, from the free queue's head
    assert ids(kv, seq, 0) == [0, 2, 3, 4]
    kv.check_invariants([seq])
    kv.free(seq)
    assert kv.num_free_blocks == kv.num_usable_blocks == 15
    # the blocks a window needs are cached: a second prompt hits on them (the dead one is null)
    again = make_seq(list(range(10)) + [7, 7, 1])
    hits, n = kv.get_computed_blocks(again)
    assert n == 12 and [b.block_id for b in hits[0]] == [0, 2, 3]


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_peak_blocks_bounds_what_a_run_holds(chunk):
    kv = hybrid(num_blocks=64, caching=False)
    seq = make_seq(range(40))
    peak = 0
    while seq.num_computed_tokens < seq.num_tokens:
        run(kv, seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))
        peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
    for _ in range(20):
        decode(kv, seq)
        peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
    assert peak <= kv.peak_blocks(seq.num_tokens, chunk)


def test_used_blocks_by_group_count_hits_frees_and_dead_blocks_exactly():
    """The O(1) per-group counts behind /metrics' pagedllm:kv_cache_group_used_blocks."""
    kv = hybrid()
    assert kv.num_used_blocks_by_group == [0, 0]  # the null block is in no group
    _cached_prompt(kv, 20)  # freed: its cached blocks count as free
    assert kv.num_used_blocks_by_group == [0, 0]
    b = make_seq(list(range(100, 120)) + [1])
    run(kv, b)  # its prefix hits leave the free queue under the group that cached them
    assert kv.prefix_cache_hits > 0
    assert kv.num_used_blocks_by_group == [len(ids(kv, b, 0)), len(
        [i for i in ids(kv, b, 1) if i != 0])]
    for _ in range(8):
        decode(kv, b)
    kv.check_invariants([b])
    assert kv.num_used_blocks_by_group[1] == 3 and kv.num_dead_blocks_freed > 0
    kv.free(b)
    assert kv.num_used_blocks_by_group == [0, 0]
    kv.check_invariants([])
