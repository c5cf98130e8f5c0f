"""Priority scheduling (vLLM's --scheduling-policy priority): waiting requests are admitted by
(priority, arrival), a preemption takes the lowest-priority (largest value) running request
first, and fcfs ignores priorities. No model."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig, check_priority
from tests.unit.test_scheduler import finish_step


def make(policy: str, num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    return Scheduler(SchedulerConfig(policy=policy, **config), kv)


def seq(sid: int, prompt_len: int, priority: int = 0, arrival: float | None = None) -> SequenceState:
    return SequenceState(seq_id=sid, request_id=f"r{sid}",
                    prompt_token_ids=[100 * (sid + 1) + i for i in range(prompt_len)],
                    arrival_time=float(sid if arrival is None else arrival), priority=priority)


def admitted_order(sched: Scheduler, steps: int = 20) -> list[int]:
    """Seq ids in the order they first ran (one seat: max_num_seqs=1, each runs to the end)."""
    order: list[int] = []
    for _ in range(steps):
        out = sched.schedule()
        for s in out.scheduled:
            if s.seq.seq_id not in order:
                order.append(s.seq.seq_id)
        finish_step(sched, out)
        for s in out.scheduled:  # one generated token each: finish it
            if s.sample:
                sched.finish_sequence(s.seq, SequenceStatus.FINISHED_STOPPED)
        if not sched.has_unfinished():
            break
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make("priority", max_num_seqs=1)
    for sid, prio in [(0, 5), (1, 1), (2, 3), (3, 1), (4, -2)]:
        sched.add_sequence(seq(sid, 4, prio))
    assert admitted_order(sched) == [4, 1, 3, 2, 0]


def test_fcfs_ignores_priority():
    sched = make("fcfs", max_num_seqs=1)
    for sid, prio in [(0, 5), (1, 1), (2, 3)]:
        sched.add_sequence(seq(sid, 4, prio))
    assert admitted_order(sched) == [0, 1, 2]


def test_preemption_takes_the_lowest_priority_running_request_first():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens hold 2 blocks each: full.
    sched = make("priority", num_blocks=6, max_num_batched_tokens=64, preemption_mode="recompute")
    urgent, low, mid = seq(0, 8, priority=0), seq(1, 8, priority=9), seq(2, 8, priority=4)
    for s in (urgent, low, mid):
        sched.add_sequence(s)
    out = sched.schedule()
    assert {s.seq.seq_id for s in out.scheduled} == {0, 1, 2}
    # running is kept in priority order, the lowest priority (largest value) last
    assert [s.seq_id for s in sched.running] == [0, 2, 1]
    finish_step(sched, out)
    out = sched.schedule()  # every decode needs a third block: the pool is short
    assert out.preempted[0] == low.seq_id  # the largest priority value goes first
    assert low.status == SequenceStatus.WAITING
    if len(out.preempted) > 1:
        assert out.preempted[1] == mid.seq_id
    assert urgent.status == SequenceStatus.RUNNING


def test_preemption_under_fcfs_takes_the_newest():
    sched = make("fcfs", num_blocks=6, max_num_batched_tokens=64, preemption_mode="recompute")
    a, b, c = seq(0, 8, priority=0), seq(1, 8, priority=9), seq(2, 8, priority=4)
    for s in (a, b, c):
        sched.add_sequence(s)
    finish_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted[0] == c.seq_id


def test_a_preempted_request_waits_behind_more_urgent_ones():
    sched = make("priority", num_blocks=6, max_num_batched_tokens=64, preemption_mode="recompute")
    for s in (seq(0, 8, 0), seq(1, 8, 9), seq(2, 8, 4)):
        sched.add_sequence(s)
    finish_step(sched, sched.schedule())
    sched.add_sequence(seq(3, 4, priority=5))
    sched.schedule()  # preempts r1 (priority 9) at least
    keys = [(s.priority, s.arrival_time) for s in sched.waiting]
    assert keys == sorted(keys)  # the whole queue in (priority, arrival) order


def test_check_priority():
    check_priority(0, "fcfs")
    check_priority(-3, "priority")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        check_priority(1, "fcfs")
    with pytest.raises(ValueError, match="integer"):
        check_priority(True, "priority")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


@pytest.mark.parametrize("seed", range(40))
def test_random_priority_mixes_drain(seed):
    """Random priorities, prompt lengths and arrivals on a tiny pool: everything accepted
    finishes (the liveness argument with priorities), and every step's admissions respect
    (priority, arrival) among those that were waiting."""
    r = random.Random(seed)
    nb, bs = r.randint(6, 16), 2
    sched = make("priority", num_blocks=nb, block_size=bs,
                 max_num_batched_tokens=r.choice([4, 8, 32]), max_num_seqs=r.randint(1, 4))
    pending = []
    for sid in range(r.randint(3, 8)):
        plen = r.randint(1, nb * bs // 2)
        pending.append((r.randint(0, 10), seq(sid, plen, r.randint(-3, 3), arrival=sid),
                        r.randint(1, nb * bs - plen)))
    budget_left = {s.seq_id: mt for _, s, mt in pending}
    for t in range(3000):
        for at, s, _ in pending:
            if at == t:
                sched.add_sequence(s)
        out = sched.schedule()
        finish_step(sched, out)
        for e in out.scheduled:
            if e.sample:
                budget_left[e.seq.seq_id] -= 1
                if budget_left[e.seq.seq_id] == 0:
                    sched.finish_sequence(e.seq, SequenceStatus.FINISHED_LENGTH)
        if t > 10 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), f"seed {seed}: stalled"
    assert sched.kv_cache_manager.num_free_blocks == nb
