"""Scheduler: budget, chunked prefill, decode priority, caps, preemption, abort, simulation."""

import collections
import random

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.core.scheduler_output import SchedulerOutput
from tests.unit.core_sim import FakeStore

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING


def make_scheduler(num_blocks=64, block_size=16, caching=True, **config):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(**config), kv), kv


class Seqs:
    """SequenceState factory: increasing ids and arrival times, distinct prompts unless given."""

    def __init__(self) -> None:
        self.next_id = 0

    def __call__(self, prompt_len=None, prompt=None, request_id=None, index=0, arrival=None):
        sid = self.next_id
        self.next_id += 1
        if prompt is None:
            prompt = [1000 * (sid + 1) + i for i in range(prompt_len)]
        return SequenceState(
            seq_id=sid,
            request_id=request_id or f"req-{sid}",
            prompt_token_ids=list(prompt),
            arrival_time=float(sid if arrival is None else arrival),
            index=index,
        )


def plan(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    """(seq_id, start_pos, num_tokens, sample) per scheduled entry."""
    return [(s.seq.seq_id, s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled]


def finish_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the forward: mark computed, append sampled tokens."""
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.sample:
            s.seq.append_token(token)


def test_token_budget_and_chunked_prefill():
    sched, kv = make_scheduler(max_num_batched_tokens=32)
    new = Seqs()
    a, b = new(50), new(10)
    sched.add_sequence(a)
    sched.add_sequence(b)

    out = sched.schedule()  # a takes the whole budget
    assert plan(out) == [(0, 0, 32, False)] and out.num_batched_tokens == 32
    assert out.scheduled[0].token_ids == a.prompt_token_ids[:32]
    assert kv.get_block_ids(out.scheduled[0].seq.seq_id) == [0, 1]
    assert sched.num_running == 1 and sched.num_waiting == 1
    finish_step(sched, out)
    assert a.num_computed_tokens == 32 and a.num_output_tokens == 0

    out = sched.schedule()  # rest of a, then all of b
    assert plan(out) == [(0, 32, 18, True), (1, 0, 10, True)]
    assert [kv.get_block_ids(s.seq.seq_id) for s in out.scheduled] == [[0, 1, 2, 3], [4]]
    assert out.num_batched_tokens == 28
    finish_step(sched, out)

    out = sched.schedule()  # both decode
    assert plan(out) == [(0, 50, 1, True), (1, 10, 1, True)]
    assert out.scheduled[0].token_ids == [7]
    assert sched.get_sequence_count() == (2, 0)


def test_decode_has_priority_over_prefill():
    sched, kv = make_scheduler(max_num_batched_tokens=4)
    new = Seqs()
    a, b, c = new(2), new(2), new(10)
    for s in (a, b):
        sched.add_sequence(s)
    out = sched.schedule()
    assert plan(out) == [(0, 0, 2, True), (1, 0, 2, True)]
    finish_step(sched, out)
    sched.add_sequence(c)
    out = sched.schedule()  # 2 decodes first, then a 2-token chunk of c
    assert plan(out) == [(0, 2, 1, True), (1, 2, 1, True), (2, 0, 2, False)]
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [(0, 3, 1, True), (1, 3, 1, True), (2, 2, 2, False)]


def test_running_prefill_is_capped_by_budget_left_after_earlier_running():
    sched, kv = make_scheduler(max_num_batched_tokens=8)
    new = Seqs()
    a, b = new(3), new(20)
    sched.add_sequence(a)
    out = sched.schedule()
    finish_step(sched, out)
    sched.add_sequence(b)
    assert plan(sched.schedule()) == [(0, 3, 1, True), (1, 0, 7, False)]


def test_max_num_seqs_cap():
    sched, kv = make_scheduler(max_num_seqs=2)
    new = Seqs()
    a, b, c = new(4), new(4), new(4)
    for s in (a, b, c):
        sched.add_sequence(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert c.status == WAITING and sched.num_waiting == 1
    finish_step(sched, out)
    sched.finish_sequence(a, SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert plan(out) == [(1, 4, 1, True), (2, 0, 4, True)]


def test_chunked_prefill_disabled_waits_for_room():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)
    sched, kv = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    new = Seqs()
    a, b, c = new(10), new(10), new(2)
    for s in (a, b, c):
        sched.add_sequence(s)
    out = sched.schedule()  # b does not fit whole: stop (c may not jump the queue)
    assert plan(out) == [(0, 0, 10, True)]
    finish_step(sched, out)
    out = sched.schedule()  # now b fits, and c after it
    assert plan(out) == [(0, 10, 1, True), (1, 0, 10, True), (2, 0, 2, True)]


def _fill_three(caching: bool):
    """3 blocks of 4 slots, three 4-token prompts: the next decode of each needs a new block."""
    sched, kv = make_scheduler(num_blocks=3, block_size=4, caching=caching)
    new = Seqs()
    a, b, c = new(4), new(4), new(4)
    for s in (a, b, c):
        sched.add_sequence(s)
    out = sched.schedule()
    assert [kv.get_block_ids(s.seq.seq_id) for s in out.scheduled] == [[0], [1], [2]]
    finish_step(sched, out, token=70)
    return sched, kv, a, b, c


def test_preemption_by_recompute_of_most_recent_arrival():
    sched, kv, a, b, c = _fill_three(caching=False)
    out = sched.schedule()
    # a needs a block: c (newest) is preempted; b then needs one: only b itself is left.
    assert out.preempted == [2, 1]
    assert plan(out) == [(0, 4, 1, True)] and kv.get_block_ids(out.scheduled[0].seq.seq_id) == [0, 2]
    assert list(sched.waiting) == [b, c]  # older preempted first
    for s in (b, c):
        assert s.status == WAITING and s.num_computed_tokens == 0 and s.num_preemptions == 1
        assert s.output_token_ids == [70]  # output kept
        assert kv.get_block_ids(s.seq_id) == []
    assert sched.num_preemptions == 2 and sched.running == [a]
    kv.check_invariants([a, b, c])
    finish_step(sched, out, token=71)

    sched.finish_sequence(a, SequenceStatus.FINISHED_LENGTH)
    assert kv.num_free_blocks == 3
    out = sched.schedule()  # b resumes as a prefill of prompt + output; c cannot fit too
    assert plan(out) == [(1, 0, 5, True)]
    assert out.scheduled[0].token_ids == b.prompt_token_ids + [70]
    assert kv.get_block_ids(out.scheduled[0].seq.seq_id) == [1, 2]  # LRU: a's blocks went back tail first
    assert list(sched.waiting) == [c]


def test_resume_after_preemption_hits_its_own_cached_prefix():
    sched, kv, a, b, c = _fill_three(caching=True)
    out = sched.schedule()
    assert out.preempted == [2, 1]
    finish_step(sched, out)
    sched.finish_sequence(a, SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    # b's full prompt block 1 is still cached: only its sampled token is recomputed.
    assert plan(out) == [(1, 4, 1, True)]
    assert out.scheduled[0].token_ids == [70] and kv.get_block_ids(out.scheduled[0].seq.seq_id) == [1, 2]
    assert b.num_computed_tokens == 4


def test_lone_sequence_preempts_itself_and_nothing_is_admitted():
    sched, kv = make_scheduler(num_blocks=2, block_size=4)
    new = Seqs()
    a, w = new(8), new(1)
    sched.add_sequence(a)
    finish_step(sched, sched.schedule())
    sched.add_sequence(w)
    out = sched.schedule()  # a needs a third block: there is none, so it preempts itself
    assert out.is_empty and out.preempted == [0]
    assert list(sched.waiting) == [a, w] and sched.num_running == 0
    assert kv.num_free_blocks == 2
    out = sched.schedule()  # a still cannot fit; w may not skip ahead (FCFS): no livelock
    assert out.is_empty and out.preempted == []


def test_abort_and_finish_free_blocks_at_once():
    sched, kv = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    new = Seqs()
    a, b, c = new(5), new(5), new(5)
    for s in (a, b, c):
        sched.add_sequence(s)
    out = sched.schedule()  # a whole, 1 token of b, c waits
    assert plan(out) == [(0, 0, 5, True), (1, 0, 1, False)]
    finish_step(sched, out)
    assert kv.num_free_blocks == 5

    assert sched.abort_request("req-1") == [b]
    assert b.status == SequenceStatus.FINISHED_ABORTED and kv.num_free_blocks == 6
    assert sched.abort_request("req-2") == [c]  # waiting: just dropped
    assert sched.abort_request("req-2") == [] and sched.abort_request("nope") == []
    assert sched.get_sequence_count() == (1, 0)
    sched.finish_sequence(a, SequenceStatus.FINISHED_STOPPED)
    sched.finish_sequence(a, SequenceStatus.FINISHED_ABORTED)  # no-op once finished
    assert a.status == SequenceStatus.FINISHED_STOPPED and a.status.finish_reason == "stop"
    assert kv.num_free_blocks == 8 and not sched.has_unfinished()
    kv.check_invariants([])


def test_update_after_step_skips_sequences_aborted_mid_step():
    sched, kv = make_scheduler(num_blocks=4, block_size=4)
    a = Seqs()(6)
    sched.add_sequence(a)
    out = sched.schedule()
    sched.abort_request(a.request_id)
    sched.update_after_step(out)
    assert a.num_computed_tokens == 0 and kv.num_free_blocks == 4


def test_fork_shares_blocks_and_copies_on_write():
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    new = Seqs()
    parent, other = new(6, request_id="r"), new(3, request_id="x")
    sched.add_sequence(parent)
    sched.add_sequence(other)
    out = sched.schedule()
    finish_step(sched, out, token=1)  # parent holds blocks 0 1, other holds 2
    children = []
    for i, tok in ((1, 2), (2, 3)):
        child = new(prompt=parent.prompt_token_ids, request_id="r", index=i, arrival=0.0)
        child.append_token(tok)
        sched.fork_sequence(parent, child)
        children.append(child)
    c1, c2 = children
    assert sched.running == [parent, c1, c2, other]
    assert kv.get_block_ids(c1.seq_id) == [0, 1] and kv.num_shared_blocks == 2
    kv.check_invariants(sched.running)

    out = sched.schedule()  # position 6 sits in shared block 1: parent and c1 copy it
    assert plan(out) == [(0, 6, 1, True), (2, 6, 1, True), (3, 6, 1, True), (1, 3, 1, True)]
    assert out.block_copies == [(1, 3), (1, 4)]
    assert [kv.get_block_ids(s.seq.seq_id) for s in out.scheduled] == [[0, 3], [0, 4], [0, 1], [2]]
    assert [s.token_ids for s in out.scheduled[:3]] == [[1], [2], [3]]
    finish_step(sched, out)
    assert sched.schedule().block_copies == []

    assert sched.abort_request("r") == [parent, c1, c2]
    assert kv.block_pool.num_used_blocks == 2 and kv.get_block_ids(other.seq_id) == [2, 5]
    kv.check_invariants(sched.running)


def test_waiting_queue_keeps_preempted_oldest_first():
    sched, kv = make_scheduler(num_blocks=4, block_size=2)
    new = Seqs()
    seqs = [new(2) for _ in range(4)]
    for s in seqs:
        sched.add_sequence(s)
    finish_step(sched, sched.schedule())  # 4 seqs x 1 block; each now needs a second block
    out = sched.schedule()
    assert out.preempted == [3, 2]
    late = new(1)
    sched.add_sequence(late)
    assert list(sched.waiting) == [seqs[2], seqs[3], late]
    finish_step(sched, out)
    out = sched.schedule()  # 0 and 1 decode inside their second block; 2 cannot come back
    assert out.preempted == [] and plan(out) == [(0, 3, 1, True), (1, 3, 1, True)]
    finish_step(sched, out)
    out = sched.schedule()  # 0 needs a third block: 1 goes, ahead of the younger 2 and 3
    assert out.preempted == [1]
    assert list(sched.waiting) == [seqs[1], seqs[2], seqs[3], late]


# ---- randomized simulation with a fake model -----------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_randomized_simulation_drains(seed):
    rng = random.Random(seed)
    B = rng.choice([2, 4, 8])
    num_blocks = rng.randint(4, 12)
    cfg = dict(
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=64,
        enable_chunked_prefill=True,
    )
    sched, kv = make_scheduler(num_blocks, B, caching=rng.random() < 0.8, **cfg)
    runner = FakeStore(kv)
    new = Seqs()
    shared_prefix = [rng.randrange(5) for _ in range(2 * B)]
    all_seqs: list[SequenceState] = []
    info: dict[int, dict] = collections.defaultdict(dict)  # the test's own per-sequence notes
    max_len = num_blocks * B  # the engine's add_request check: fits alone in the pool
    preemptions_seen = copies_seen = 0

    for step in range(2000):
        if step < 150 and rng.random() < 0.3:
            prompt_len = rng.randint(1, max_len - 1)
            prompt = (shared_prefix + [rng.randrange(5) for _ in range(max_len)])[:prompt_len]
            if rng.random() < 0.5:
                prompt = [rng.randrange(5) for _ in range(prompt_len)]
            seq = new(prompt=prompt)
            info[seq.seq_id]["max_tokens"] = rng.randint(1, max_len - prompt_len)
            info[seq.seq_id]["n"] = rng.choice([1, 1, 1, 2, 3])
            sched.add_sequence(seq)
            all_seqs.append(seq)
        if rng.random() < 0.03 and sched.running:  # abort something
            victim = rng.choice(sched.running + list(sched.waiting))
            assert sched.abort_request(victim.request_id)
        if not sched.has_unfinished():
            if step >= 150:
                break
            continue

        computed_before = {s.seq_id: s.num_computed_tokens for s in sched.running}
        out = sched.schedule()
        preemptions_seen += len(out.preempted)
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) and not set(ids) & set(out.preempted)
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_batched_tokens <= cfg["max_num_batched_tokens"]
        old = [i for i in ids if i in computed_before]
        assert ids[: len(old)] == old  # running ones first
        if len(old) < len(ids):  # admitted only below the cap (forks may exceed it)
            assert sched.num_running <= cfg["max_num_seqs"]
        if out.preempted:
            assert all(i in computed_before for i in ids)  # nothing admitted
        for s in out.scheduled:
            assert s.start_pos == s.seq.num_computed_tokens
            assert s.token_ids == s.seq.all_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            assert len(kv.get_block_ids(s.seq.seq_id)) * B >= s.start_pos + len(s.token_ids)
            assert s.sample == (s.start_pos + len(s.token_ids) == s.seq.num_tokens)
        kv.check_invariants(sched.running + list(sched.waiting))

        runner.execute(out)
        copies_seen += len(out.block_copies)
        sched.update_after_step(out)
        for s in out.scheduled:
            seq = s.seq
            if not s.sample:
                continue
            seq.append_token(rng.randrange(5))
            family = [seq]
            if seq.num_output_tokens == 1 and seq.index == 0 and seq.num_preemptions == 0:
                for i in range(1, info[seq.seq_id]["n"]):  # n > 1: fork after the prefill
                    child = new(
                        prompt=seq.prompt_token_ids,
                        request_id=seq.request_id,
                        index=i,
                        arrival=seq.arrival_time,
                    )
                    child.append_token(rng.randrange(5))
                    info[child.seq_id]["max_tokens"] = info[seq.seq_id]["max_tokens"]
                    sched.fork_sequence(seq, child)
                    all_seqs.append(child)
                    family.append(child)
            for member in family:
                if member.num_output_tokens >= info[member.seq_id]["max_tokens"]:
                    sched.finish_sequence(member, SequenceStatus.FINISHED_LENGTH)
        kv.check_invariants(sched.running + list(sched.waiting))
        runner.check(sched)
    else:
        pytest.fail("the simulation did not drain")

    assert all(s.is_finished for s in all_seqs)
    for s in all_seqs:  # finished by length ones produced exactly max_tokens
        if s.status == SequenceStatus.FINISHED_LENGTH:
            assert s.num_output_tokens == info[s.seq_id]["max_tokens"]
    assert kv.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in kv.block_pool.blocks)
    assert preemptions_seen == sched.num_preemptions
    kv.check_invariants([])


def deltas(out: SchedulerOutput) -> list[tuple[int, int, list[int]]]:
    """(seq_id, blocks_from, new_block_ids) per scheduled entry."""
    return [(s.seq.seq_id, s.blocks_from, s.new_block_ids) for s in out.scheduled]


def test_tables_travel_as_deltas_new_blocks_copy_on_write_and_releases():
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    new = Seqs()
    parent, other = new(6, request_id="r"), new(3, request_id="x")
    sched.add_sequence(parent)
    sched.add_sequence(other)
    out = sched.schedule()
    assert deltas(out) == [(0, 0, [0, 1]), (1, 0, [2])]  # new to the runner: whole
    finish_step(sched, out, token=1)
    child = new(prompt=parent.prompt_token_ids, request_id="r", index=1, arrival=0.0)
    child.append_token(2)
    sched.fork_sequence(parent, child)
    out = sched.schedule()  # both write into shared block 1: copies; other stays in block 2
    assert out.block_copies == [(1, 3)]
    assert deltas(out) == [(0, 1, [3]), (2, 0, [0, 1]), (1, 1, [])]
    finish_step(sched, out)
    out = sched.schedule()  # nothing changed: nothing travels; other's next block is new
    assert deltas(out) == [(0, 2, []), (2, 2, []), (1, 1, [4])]
    finish_step(sched, out)
    assert sched.abort_request("r") == [parent, child]
    out = sched.schedule()
    assert out.released_seq_ids == [0, 2] and deltas(out) == [(1, 2, [])]
    assert sched.schedule().released_seq_ids == []  # once


def test_a_recomputed_sequence_is_released_and_sent_whole_again():
    sched, kv, a, b, c = _fill_three(caching=False)
    out = sched.schedule()  # c then b preempted (recompute): their tables go
    assert out.preempted == [2, 1] and out.released_seq_ids == [2, 1]
    assert deltas(out) == [(0, 1, [2])]
    finish_step(sched, out)
    sched.finish_sequence(a, SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert out.released_seq_ids == [0]
    assert [(sid, start) for sid, start, _ in deltas(out)] == [(1, 0)]  # b, whole again


def test_a_recompute_preempted_sequence_waits_until_its_whole_length_fits():
    """Readmitted on its first chunk, a preempted sequence would be preempted again as soon as
    the running ones grow: it comes back only when the free blocks hold all its tokens."""
    # (no prefix caching: b's cached blocks would otherwise make it wait for them)
    sched, kv = make_scheduler(num_blocks=10, block_size=4, caching=False, max_num_batched_tokens=8)
    new = Seqs()
    a, b = new(16), new(16)  # 4 blocks each; a decodes, b is preempted once the pool is short
    for s in (a, b):
        sched.add_sequence(s)
    while b.num_computed_tokens < 16:  # a's prompt in two chunks, then b's while a decodes
        finish_step(sched, sched.schedule())
    while not b.num_preemptions:  # both decode; a grows until b is pushed out
        finish_step(sched, sched.schedule())
    assert b in sched.waiting and sched.running == [a]
    # b now needs ceil(b.num_tokens / 4) = 5 blocks; while fewer are free it is not readmitted
    # (before: its first 8-token chunk fit, it ran, and was preempted again the next steps)
    while kv.num_free_blocks < -(-b.num_tokens // 4):
        out = sched.schedule()
        assert [s.seq for s in out.scheduled] == [a], plan(out)
        finish_step(sched, out)
        if a.num_tokens >= 36:
            sched.finish_sequence(a, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert b in [s.seq for s in out.scheduled]
    assert b.num_preemptions == 1
    kv.check_invariants([s for s in (a, b) if not s.is_finished])
