"""Block sharing without a model: prefix-cache admission (counted once, in-flight prefixes wait
a step), LRU eviction of cached blocks, the shared-block counter, beam-style fork and drop."""

import random

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig

_ids = iter(range(10**9))


def seq(prompt, output=(), request_id=None, salt=None) -> SequenceState:
    sid = next(_ids)
    return SequenceState(seq_id=sid, request_id=request_id or f"r{sid}", prompt_token_ids=list(prompt),
                    arrival_time=float(sid), output_token_ids=list(output), cache_salt=salt)


def plan(out):
    return [(s.seq.seq_id, s.start_pos, len(s.token_ids)) for s in out.scheduled]


def finish_step(sched, out, token=7):
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.sample:
            s.seq.append_token(token)


def test_hash_chain_is_parent_tokens_and_salt():
    h0 = hash_block_tokens(None, [1, 2], ("s",))
    assert h0 == hash_block_tokens(None, (1, 2), ("s",)) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h0, [3, 4]) != hash_block_tokens(None, [3, 4])
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], salt="s")
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    assert kv.req_to_block_hashes[a.seq_id] == [h0, hash_block_tokens(h0, [3, 4])]
    assert [b.block_hash for b in kv.block_pool.blocks] == [h0, hash_block_tokens(h0, [3, 4]),
                                                           None]  # block 3: never used yet


def test_same_prefix_arriving_together_waits_one_step_and_hits():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                      kv := KVCacheManager(num_blocks=16, block_size=4))
    system = list(range(100, 112))  # 3 full blocks
    a, b = seq(system + [1, 2]), seq(system + [3, 4])
    other = seq([9, 9, 9, 9, 9])
    for s in (a, b, other):
        sched.add_sequence(s)
    out = sched.schedule()
    # b's first block is being computed by a this step: b waits; `other` may go ahead.
    assert plan(out) == [(a.seq_id, 0, 14), (other.seq_id, 0, 5)]
    assert list(sched.waiting) == [b]
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out)[-1] == (b.seq_id, 12, 2)  # 12 tokens from the cache, 2 computed
    assert kv.get_block_ids(out.scheduled[-1].seq.seq_id)[:3] == kv.get_block_ids(out.scheduled[0].seq.seq_id)[:3]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (14 + 5 + 14, 12)
    assert b.num_cached_tokens == 12 and a.num_cached_tokens == 0


def test_without_caching_nothing_waits():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                      KVCacheManager(num_blocks=16, block_size=4, enable_caching=False))
    a, b = seq(list(range(12)) + [1]), seq(list(range(12)) + [2])
    sched.add_sequence(a)
    sched.add_sequence(b)
    assert plan(sched.schedule()) == [(a.seq_id, 0, 13), (b.seq_id, 0, 13)]


def test_lookup_is_counted_once_per_admission():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                      kv := KVCacheManager(num_blocks=4, block_size=4))
    big, small = seq(range(16)), seq(range(50, 55))
    sched.add_sequence(big)
    out = sched.schedule()
    finish_step(sched, out)
    sched.add_sequence(small)
    for _ in range(3):  # small waits for room: looked up each step, counted never
        sched.schedule()
        assert small.status == SequenceStatus.WAITING
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16, 0)
    sched.finish_sequence(big, SequenceStatus.FINISHED_LENGTH)
    sched.schedule()
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (16 + 5, 0)


def test_lru_eviction_order_and_surviving_prefix_hits():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = seq([1, 2, 3, 4, 5, 6, 7])  # blocks 0 1 2 full + 3
    assert kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    kv.cache_full_blocks(a)
    kv.free(a)  # tail first: 3, 2, 1, 0 join the queue behind 4, 5
    assert list(kv.block_pool.free_block_ids()) == [4, 5, 3, 2, 1, 0]
    b = seq([8, 9, 8, 9, 8, 9, 8])  # 4 blocks: takes 4, 5, 3 (unhashed) and evicts 2
    assert kv.allocate_slots(b, 7) and kv.get_block_ids(b.seq_id) == [4, 5, 3, 2]
    assert kv.block_pool.blocks[2].block_hash is None
    c = seq([1, 2, 3, 4, 5, 6, 0])  # a's first two blocks survive; the third was evicted
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0, 1] and n == 4
    assert not kv.allocate_slots(c, 3, hits)  # the hits are the only free blocks: no room
    kv.free(b)  # queue: 1 0 (still cached), then b's 2 3 5 4
    assert kv.allocate_slots(c, 3, hits) and kv.get_block_ids(c.seq_id) == [0, 1, 2, 3]
    kv.free(c)
    assert kv.num_free_blocks == 6
    kv.check_invariants([])


def test_multi_turn_hits_the_generated_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = seq([1, 2, 3])
    for token in (10, 11, 12, 13, 14, 15):  # prefill, decodes: 8 computed fill blocks 0, 1
        assert kv.allocate_slots(a, a.num_tokens - a.num_computed_tokens)
        a.num_computed_tokens = a.num_tokens
        kv.cache_full_blocks(a)
        a.append_token(token)
    kv.free(a)
    follow_up = seq(a.all_token_ids + [20, 21])  # the next turn carries the whole exchange
    assert kv.get_computed_blocks(follow_up)[1] == 8


def test_shared_block_counter_matches_ref_counts():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=2)
    live: list[SequenceState] = []
    for _ in range(500):
        r = rng.random()
        if r < 0.3 or not live:
            s = seq([rng.randrange(2) for _ in range(rng.randint(1, 6))])
            hits, n = kv.get_computed_blocks(s)
            if kv.allocate_slots(s, s.num_tokens - n, hits or None):
                s.num_computed_tokens = s.num_tokens
                kv.cache_full_blocks(s)
                live.append(s)
        elif r < 0.6:
            parent = rng.choice(live)
            child = seq(parent.prompt_token_ids, parent.output_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            live.append(child)
        elif r < 0.8:
            s = rng.choice(live)
            s.append_token(rng.randrange(2))
            if kv.allocate_slots(s, 1):
                kv.take_pending_copies()
                s.num_computed_tokens += 1
                kv.cache_full_blocks(s)
            else:
                kv.free(s)
                live.remove(s)
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        brute = sum(1 for b in kv.block_pool.blocks if b.ref_count > 1)
        assert kv.num_shared_blocks == brute
        kv.check_invariants(live)
    for s in live:
        kv.free(s)
    assert kv.num_shared_blocks == 0 and kv.num_free_blocks == 24


def test_beam_style_fork_and_drop_frees_only_unshared_blocks():
    """A beam step: beam 0 is chosen twice (forks), beam 1 is dropped."""
    sched = Scheduler(SchedulerConfig(), kv := KVCacheManager(num_blocks=12, block_size=4))
    root = seq(range(6), request_id="beam")
    sched.add_sequence(root)
    finish_step(sched, sched.schedule(), token=1)  # blocks 0, 1 (half)
    b1 = seq(root.prompt_token_ids, [2], request_id="beam")
    sched.fork_sequence(root, b1)
    finish_step(sched, out := sched.schedule(), token=3)
    assert out.block_copies == [(1, 2)]  # root copies the shared half block; b1 writes 1
    assert [kv.get_block_ids(s.seq_id) for s in (root, b1)] == [[0, 2], [0, 1]]

    # Next step: root survives twice, b1 is dropped.
    twin = seq(root.prompt_token_ids, root.output_token_ids[:-1] + [4], request_id="beam")
    sched.fork_sequence(root, twin)
    sched.finish_sequence(b1, SequenceStatus.FINISHED_ABORTED)
    assert [b.ref_count for b in kv.block_pool.blocks[:3]] == [2, 0, 2]
    assert kv.num_free_blocks == 10 and kv.num_shared_blocks == 2
    out = sched.schedule()  # both write position 7 of shared block 2: root copies it first
    assert out.block_copies == [(2, 3)]
    assert [kv.get_block_ids(s.seq.seq_id) for s in out.scheduled] == [[0, 3], [0, 2]]
    kv.check_invariants(sched.all_unfinished())
    sched.abort_request("beam")
    assert kv.num_free_blocks == 12 and kv.num_shared_blocks == 0
    kv.check_invariants([])
