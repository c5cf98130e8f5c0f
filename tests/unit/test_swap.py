"""Swap preemption without a model: exact host/device block maps, ref counts, the copies the
runner is asked to do, scheduler policy (groups swapped, singles recomputed, swapped first)."""

import collections
import random

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from tests.unit.core_sim import FakeStore

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED


def seq(seq_id, prompt, request_id=None, output=(), arrival=None, index=0) -> SequenceState:
    return SequenceState(
        seq_id=seq_id,
        request_id=request_id or f"r{seq_id}",
        prompt_token_ids=list(prompt),
        arrival_time=float(seq_id if arrival is None else arrival),
        output_token_ids=list(output),
        index=index,
    )


def computed(kv, s, n=None):
    """Allocate and mark computed (no prefix lookup), like one step."""
    n = s.num_tokens - s.num_computed_tokens if n is None else n
    assert kv.allocate_slots(s, n)
    s.num_computed_tokens += n
    kv.cache_full_blocks(s)


def host_refs(kv):
    return [b.ref_count for b in kv.host_pool.blocks] + [0] * kv.host_pool.num_fresh


def fork(kv, parent, child_id, token):
    child = seq(child_id, parent.prompt_token_ids, parent.request_id,
                output=parent.output_token_ids[:-1] + [token], arrival=parent.arrival_time)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    return child


def test_swap_out_keeps_sharing_and_swap_in_remaps():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, num_host_blocks=6)
    a = seq(0, range(6))  # blocks 0, 1 (1 half full)
    computed(kv, a)
    a.append_token(60)
    b = fork(kv, a, 1, 61)  # shares 0 and 1
    assert kv.get_block_ids(1) == [0, 1] and kv.num_shared_blocks == 2

    assert kv.num_swap_out_blocks([a, b]) == 2 and kv.can_swap_out([a, b])
    kv.swap_out([a, b])
    out, inn = kv.take_pending_swaps()
    assert out == [(0, 0), (1, 1)] and inn == []  # each shared block stored once
    assert [h.block_id for h in kv.swapped_tables[0]] == [0, 1] == [
        h.block_id for h in kv.swapped_tables[1]]
    assert host_refs(kv) == [2, 2, 0, 0, 0, 0]
    assert kv.num_free_blocks == 8 and kv.get_block_ids(0) == [] and kv.num_shared_blocks == 0
    kv.check_invariants([a, b])

    other = seq(2, range(100, 108))  # takes device blocks 2, 3 meanwhile
    computed(kv, other)
    assert kv.get_block_ids(2) == [2, 3]

    assert kv.num_swap_in_blocks([a, b]) == 2
    assert kv.swap_in([a, b])
    out, inn = kv.take_pending_swaps()
    assert out == [] and inn == [(0, 4), (1, 5)]
    assert kv.get_block_ids(0) == [4, 5] == kv.get_block_ids(1)
    assert kv.num_shared_blocks == 2 and host_refs(kv) == [0] * 6
    assert (kv.num_swapped_out, kv.num_swapped_in) == (2, 2)
    kv.check_invariants([a, b, other])

    # a writes position 6 of the shared block 5: copy-on-write as before the swap; b is then
    # its only owner and writes in place.
    assert kv.allocate_slots(a, 1) and kv.allocate_slots(b, 1)
    assert kv.take_pending_copies() == [(5, 6)]
    assert kv.get_block_ids(0) == [4, 6] and kv.get_block_ids(1) == [4, 5]
    for s in (a, b, other):
        kv.free(s)
    assert kv.num_free_blocks == 8 and kv.num_free_host_blocks == 6
    kv.check_invariants([])


def test_swap_out_of_a_block_copied_this_step_reads_the_copy_source():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, num_host_blocks=4)
    a = seq(0, range(6))
    computed(kv, a)
    a.append_token(60)
    b = fork(kv, a, 1, 61)
    assert kv.allocate_slots(a, 1)  # CoW: a gets block 2, copy (1 -> 2) queued
    assert kv.get_block_ids(0) == [0, 2]
    kv.swap_out([a, b])
    out, _ = kv.take_pending_swaps()
    # Block 2 holds nothing yet: its host copy is read from block 1, and the CoW is dropped.
    assert out == [(0, 0), (1, 1), (1, 2)]  # host 1 (for block 2) is read from block 1
    assert kv.take_pending_copies() == []
    assert host_refs(kv) == [2, 1, 1, 0]
    kv.check_invariants([a, b])


def test_free_drops_a_copy_into_a_freed_block():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    a = seq(0, range(6))
    computed(kv, a)
    a.append_token(60)
    b = fork(kv, a, 1, 61)
    assert kv.allocate_slots(a, 1)  # copy (1 -> 2)
    kv.free(a)  # preempted in the same step: block 2 may be handed out again
    assert kv.take_pending_copies() == []
    assert kv.allocate_slots(b, 1)  # b is alone on block 1 again: no copy
    assert kv.take_pending_copies() == []


def test_swap_out_needs_room_in_the_host_pool():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=1)
    a = seq(0, range(6))
    computed(kv, a)
    assert not kv.can_swap_out([a])
    with pytest.raises(ValueError, match="host blocks"):
        kv.swap_out([a])
    assert not KVCacheManager(4, 4).can_swap_out([a])  # no host pool at all


def test_swapped_in_blocks_are_cached_again():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=4)
    a = seq(0, range(9))
    computed(kv, a)
    kv.swap_out([a])
    kv.take_pending_swaps()
    # Device blocks 0, 1 keep their hashes in the free queue until they are reused.
    assert kv.get_computed_blocks(seq(1, range(9)))[1] == 8
    kv.block_pool.get_new_blocks(6)  # reuse them all: evicted
    kv.block_pool.free_blocks(kv.block_pool.blocks)
    assert kv.get_computed_blocks(seq(2, range(9)))[1] == 0
    assert kv.swap_in([a])
    assert kv.get_computed_blocks(seq(3, range(9)))[1] == 8  # published again
    kv.check_invariants([a])


# ---- scheduler policy ---------------------------------------------------------------------------


def make(num_blocks, block_size=4, host=8, **cfg):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False, num_host_blocks=host)
    return Scheduler(SchedulerConfig(**cfg), kv), kv


def step(sched, out: SchedulerOutput, token=7):
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.sample:
            s.seq.append_token(token)


def group_of_two(sched, kv, first_id, prompt_len, arrival, rid):
    """A request with a prompt and one fork, both running, each with one uncomputed token."""
    p = seq(first_id, range(prompt_len), rid, arrival=arrival)
    sched.add_sequence(p)
    step(sched, sched.schedule(), token=1)
    c = seq(first_id + 1, p.prompt_token_ids, rid, output=[2], arrival=arrival, index=1)
    sched.fork_sequence(p, c)
    return p, c


def full_pool(**cfg):
    """Pool of 5 blocks of 4, exactly full: a (oldest, 8 tokens computed, blocks 0 1) and
    group g = p + fork c (5 computed, sharing block 2, each with its own 3 and 4). The next
    step, a crosses into a third block and must preempt."""
    sched, kv = make(num_blocks=5, **cfg)
    a = seq(0, range(6), "a")
    sched.add_sequence(a)
    step(sched, sched.schedule())
    p, c = group_of_two(sched, kv, 1, 4, arrival=1.0, rid="g")
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 2] and kv.num_free_blocks == 0
    step(sched, out)
    assert a.num_computed_tokens == 8 and p.num_computed_tokens == 5 == c.num_computed_tokens
    return sched, kv, a, p, c


def test_group_is_swapped_and_swapped_come_back_first():
    sched, kv, a, p, c = full_pool()
    late = seq(3, range(3), "late", arrival=3.0)
    sched.add_sequence(late)
    out = sched.schedule()  # a needs a block: g (2 running seqs) is swapped out whole
    assert out.preempted == [1, 2] and p.status == SWAPPED == c.status
    # Freed tail first: p's 3 (now free), then c's 4, then the shared 2 (last reference).
    assert list(kv.block_pool.free_block_ids()) == [4, 2]
    assert [s.seq.seq_id for s in out.scheduled] == [0] and kv.get_block_ids(out.scheduled[0].seq.seq_id) == [0, 1, 3]
    assert out.blocks_to_swap_out == [(2, 0), (3, 1), (4, 2)] and out.blocks_to_swap_in == []
    assert host_refs(kv)[:3] == [2, 1, 1]
    assert sched.swapped == [[p, c]] and sched.num_swapped == 2 and sched.num_preemptions == 2
    kv.check_invariants(sched.all_unfinished())
    step(sched, out)

    # g needs its 3 blocks + 1 per sequence to come back; 2 are free. `late` would fit in
    # one, but nothing new is admitted while a group waits in host memory.
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0] and not out.blocks_to_swap_in
    assert list(sched.waiting) == [late]
    step(sched, out)

    sched.finish_sequence(a, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()  # g comes back first, then `late` is admitted behind it
    assert out.blocks_to_swap_in == [(0, 4), (1, 2), (2, 3)] and out.preempted == []
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2, 3]
    assert [kv.get_block_ids(s.seq.seq_id) for s in out.scheduled][:2] == [[4, 2], [4, 3]]
    assert p.status == RUNNING == c.status and kv.num_shared_blocks == 1
    kv.check_invariants(sched.all_unfinished())


def test_single_sequence_is_recomputed_by_default_and_swapped_when_forced():
    for mode, expected in ((None, WAITING), ("swap", SWAPPED), ("recompute", WAITING)):
        sched, kv = make(num_blocks=3, preemption_mode=mode)
        a, b = seq(0, range(4), "a"), seq(1, range(4), "b")
        for s in (a, b):
            sched.add_sequence(s)
        step(sched, sched.schedule())  # each holds one full block and samples a token
        a.append_token(9)  # a now needs a second block too (the pool has 1 free)
        out = sched.schedule()
        assert out.preempted == [1] and b.status == expected, mode
        assert bool(out.blocks_to_swap_out) == (expected == SWAPPED)
        kv.check_invariants(sched.all_unfinished())


def test_forced_recompute_preempts_group_members_one_by_one():
    sched, kv, a, p, c = full_pool(preemption_mode="recompute")
    out = sched.schedule()
    assert out.preempted == [2] and c.status == WAITING and p.status == RUNNING
    assert out.blocks_to_swap_out == [] and kv.num_free_host_blocks == 8


def test_full_host_pool_falls_back_to_recompute():
    sched, kv, a, p, c = full_pool(host=2)
    out = sched.schedule()  # g needs 3 host blocks, there are 2: c is recomputed instead
    assert out.preempted == [2] and c.status == WAITING and out.blocks_to_swap_out == []


def test_group_scheduled_before_its_own_preemption_is_unscheduled():
    # The group itself is the newest and the one short of blocks: members already scheduled
    # this step are taken back (budget refunded), and the whole group is swapped out.
    sched, kv = make(num_blocks=4, host=8)
    old = seq(0, range(4), "old")
    sched.add_sequence(old)
    step(sched, sched.schedule())
    p, c = group_of_two(sched, kv, 1, 6, arrival=1.0, rid="g")  # blocks 1, 2 shared (2 half)
    # p writes position 7 into shared block 2: CoW takes block 3; c then finds no block.
    out = sched.schedule()
    assert out.preempted == [1, 2] and out.blocks_to_swap_out and out.block_copies == []
    assert [s.seq.seq_id for s in out.scheduled] == [0] and out.num_batched_tokens == 1
    assert sched.swapped == [[p, c]]
    kv.check_invariants(sched.all_unfinished())


def test_group_that_can_never_come_back_is_recomputed():
    sched, kv = make(num_blocks=4, host=8)
    p, c = group_of_two(sched, kv, 0, 4, arrival=0.0, rid="g")  # share block 0
    for _ in range(4):  # positions 4..7: one block each, 3 of 4 in use
        step(sched, sched.schedule())
    assert kv.num_free_blocks == 1 and p.num_computed_tokens == 8
    out = sched.schedule()  # p takes the last block for position 8; c has none: g swaps out
    assert out.preempted == [0, 1] and out.scheduled == [] and len(out.blocks_to_swap_out) == 4
    assert p.status == SWAPPED and kv.num_free_blocks == 4
    # Coming back needs 4 blocks + 1 per sequence > the whole pool: recompute them instead.
    out = sched.schedule()
    assert out.blocks_to_swap_in == [] and kv.num_free_host_blocks == 8
    assert [(s.seq.seq_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [(0, 0, 9)]
    assert list(sched.waiting) == [c] and c.num_computed_tokens == 0
    assert sched.num_preemptions == 2  # the switch to recompute is not a second preemption
    kv.check_invariants(sched.all_unfinished())


def test_forced_swap_mid_prefill_comes_back_in_budget_sized_chunks():
    sched, kv = make(num_blocks=12, max_num_batched_tokens=8, preemption_mode="swap")
    b = seq(0, range(30), "b")
    sched.add_sequence(b)
    step(sched, sched.schedule())  # first chunk: 8 tokens, blocks 0 1
    sched._preempt_by_swap([b])  # as a preemption in the middle of its prefill would
    assert b.status == SWAPPED and kv.take_pending_swaps()[0] == [(0, 0), (1, 1)]
    # Back when its 2 blocks + the 6 its remaining 22 tokens need + 1 fit; 8 tokens a step.
    out = sched.schedule()
    assert len(out.blocks_to_swap_in) == 2
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [(8, 8, False)]
    step(sched, out)
    out = sched.schedule()
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [(16, 8, False)]
    kv.check_invariants(sched.all_unfinished())


def test_group_larger_than_max_num_seqs_comes_back_when_alone():
    sched, kv = make(num_blocks=8, max_num_seqs=2)
    p, c = group_of_two(sched, kv, 0, 4, arrival=0.0, rid="g")
    c2 = seq(2, p.prompt_token_ids, "g", output=[3], arrival=0.0, index=2)
    sched.fork_sequence(p, c2)  # forks may exceed max_num_seqs
    sched._preempt_by_swap([p, c, c2])
    out = sched.schedule()
    assert sched.num_running == 3 and len(out.scheduled) == 3 and out.blocks_to_swap_in


def test_abort_of_a_swapped_group_frees_its_host_blocks():
    sched, kv, a, p, c = full_pool()
    step(sched, sched.schedule())
    assert sched.num_swapped == 2 and kv.num_free_host_blocks == 5
    assert sched.abort_request("g") == [p, c]
    assert sched.swapped == [] and kv.num_free_host_blocks == 8
    sched.abort_request("a")
    assert kv.num_free_blocks == 5 and not sched.has_unfinished()
    kv.check_invariants([])


# ---- randomized: forks, swaps and recomputes with a fake KV store ---------------------------------


def simulate(seed: int) -> dict[str, int]:
    """Random requests (n = 1..3), aborts, a small pool; checks every step; returns counts."""
    rng = random.Random(seed)
    B = rng.choice([2, 4])
    num_blocks = rng.randint(6, 14)
    mode = rng.choice([None, None, "swap", "recompute"])
    kv = KVCacheManager(num_blocks, B, enable_caching=rng.random() < 0.7,
                        num_host_blocks=rng.choice([0, 4, 32]) if mode != "swap" else 32)
    sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(2, 8),
                                      max_num_batched_tokens=rng.choice([8, 16, 64]),
                                      max_model_len=64, preemption_mode=mode), kv)
    store = FakeStore(kv)
    ids = iter(range(10**6))
    all_seqs: list[SequenceState] = []
    info: dict[int, dict] = collections.defaultdict(dict)  # the test's own per-sequence notes
    shared = [rng.randrange(4) for _ in range(2 * B)]
    seen = {"swap_out": 0, "swap_in": 0, "preempted": 0}
    for t in range(3000):
        if t < 120 and rng.random() < 0.25:
            n = rng.choice([1, 2, 3])
            # A forked group must fit unshared in the pool (the engine's beam-search check).
            max_len = num_blocks * B // n
            plen = rng.randint(1, max_len - 1)
            prompt = (shared + [rng.randrange(4) for _ in range(max_len)])[:plen]
            sid = next(ids)
            s = seq(sid, prompt, f"q{sid}", arrival=float(t))
            info[s.seq_id].update(max_tokens=rng.randint(1, max_len - plen), n=n)
            sched.add_sequence(s)
            all_seqs.append(s)
        if rng.random() < 0.02 and sched.has_unfinished():
            victim = rng.choice(sched.all_unfinished())
            assert sched.abort_request(victim.request_id)
        if not sched.has_unfinished():
            if t >= 120:
                break
            continue
        out = sched.schedule()
        seen["swap_out"] += len(out.blocks_to_swap_out)
        seen["swap_in"] += len(out.blocks_to_swap_in)
        seen["preempted"] += len(out.preempted)
        kv.check_invariants(sched.all_unfinished())
        store.execute(out)
        sched.update_after_step(out)
        for item in out.scheduled:
            s = item.seq
            if not item.sample or s.is_finished:
                continue
            s.append_token(rng.randrange(4))
            family = [s]
            if s.num_output_tokens == 1 and s.index == 0 and not info[s.seq_id].get("forked"):
                info[s.seq_id]["forked"] = True
                for i in range(1, info[s.seq_id]["n"]):
                    c = seq(next(ids), s.prompt_token_ids, s.request_id,
                            output=[rng.randrange(4)], arrival=s.arrival_time, index=i)
                    info[c.seq_id].update(max_tokens=info[s.seq_id]["max_tokens"], forked=True)
                    sched.fork_sequence(s, c)
                    all_seqs.append(c)
                    family.append(c)
            for m in family:
                if m.num_output_tokens >= info[m.seq_id]["max_tokens"]:
                    sched.finish_sequence(m, SequenceStatus.FINISHED_LENGTH)
        kv.check_invariants(sched.all_unfinished())
        store.check(sched)
    else:
        pytest.fail("the simulation did not drain")
    assert all(s.is_finished for s in all_seqs)
    assert kv.num_free_blocks == num_blocks and kv.num_shared_blocks == 0
    assert kv.host_pool is None or kv.num_free_host_blocks == kv.host_pool.num_blocks
    assert seen["swap_out"] == kv.num_swapped_out and seen["swap_in"] == kv.num_swapped_in
    assert seen["preempted"] == sched.num_preemptions
    kv.check_invariants([])
    return seen


@pytest.mark.parametrize("seed", range(10))
def test_randomized_swap_simulation(seed):
    simulate(seed)


def test_randomized_simulations_really_swap_and_recompute():
    """The seeds above do swap groups out and back (else those tests could pass vacuously)."""
    counts = [simulate(seed) for seed in range(10)]
    assert sum(c["swap_out"] for c in counts) > 20
    assert sum(c["swap_in"] for c in counts) > 20
    assert sum(c["preempted"] for c in counts) > sum(c["swap_out"] > 0 for c in counts)
