"""Speculative decoding in core/ (no model): draft tokens ride a decode step within the token
budget, rejected ones give their slots and blocks back exactly, and only accepted tokens'
full blocks are hashed."""

from __future__ import annotations

from pagedllm.core.request import SequenceStatus
from tests.unit.test_scheduler import Seqs, finish_step, make_scheduler, plan


def _decoding(sched, new, prompt_len=6):
    seq = new(prompt_len)
    sched.add_sequence(seq)
    while not seq.output_token_ids:  # prefill (in chunks), one token sampled
        finish_step(sched, sched.schedule(), token=70)
    return seq


def test_drafts_follow_the_last_token_within_the_budget():
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    new = Seqs()
    a = _decoding(sched, new)
    a.spec_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    s = out.scheduled[0]
    assert s.token_ids == [70, 11, 12, 13] and s.draft_token_ids == [11, 12, 13]  # budget 4
    assert plan(out) == [(a.seq_id, 6, 4, True)] and out.num_batched_tokens == 4
    assert kv.get_block_ids(a.seq_id) == [0, 1, 2]  # slots for positions 0..9


def test_rejected_drafts_roll_back_blocks_and_counts_exactly():
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    new = Seqs()
    a = _decoding(sched, new)  # 7 tokens: blocks [0, 1]
    a.spec_token_ids = [11, 12, 13, 14, 15, 16]
    out = sched.schedule()  # positions 6..12: blocks [0, 1, 2, 3]
    assert kv.get_block_ids(a.seq_id) == [0, 1, 2, 3]
    sched.update_after_step(out, {a.seq_id: 1})  # 11 accepted, 12 rejected
    assert a.num_computed_tokens == 8 and a.spec_token_ids == []
    assert kv.get_block_ids(a.seq_id) == [0, 1, 2]  # 9 slots: the accepted, the next sampled
    for t in (11, 40):  # the engine appends the accepted draft and the corrected token
        a.append_token(t)
    kv.check_invariants([a])
    assert kv.num_free_blocks == 16 - 3
    # only blocks full of accepted tokens are hashed: block 1 (positions 4..7) now, not block 2
    assert len(kv.req_to_block_hashes[a.seq_id]) == 1
    out = sched.schedule()  # the next decode: the runner gets block 2 and nothing stale
    assert out.scheduled[0].token_ids == [40] and out.scheduled[0].start_pos == 8
    sched.update_after_step(out)
    assert len(kv.req_to_block_hashes[a.seq_id]) == 2
    kv.check_invariants([a])


def test_all_accepted_and_none_accepted():
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    new = Seqs()
    a = _decoding(sched, new)
    a.spec_token_ids = [11, 12]
    out = sched.schedule()
    sched.update_after_step(out, {a.seq_id: 2})
    assert a.num_computed_tokens == 9
    for t in (11, 12, 13):
        a.append_token(t)
    kv.check_invariants([a])
    a.spec_token_ids = [21, 22, 23]
    out = sched.schedule()
    assert out.scheduled[0].token_ids == [13, 21, 22, 23]
    sched.update_after_step(out, {a.seq_id: 0})
    assert a.num_computed_tokens == 10 and kv.get_block_ids(a.seq_id) == [0, 1, 2]
    a.append_token(30)
    kv.check_invariants([a])
    sched.finish_sequence(a, SequenceStatus.FINISHED_STOPPED)
    assert kv.num_free_blocks == 16
    kv.check_invariants([])


def test_a_bad_accept_count_is_refused():
    import pytest

    sched, kv = make_scheduler(num_blocks=16, block_size=4)
    a = _decoding(sched, Seqs())
    a.spec_token_ids = [1, 2]
    out = sched.schedule()
    with pytest.raises(ValueError, match="3 of 2 draft tokens"):
        sched.update_after_step(out, {a.seq_id: 3})


def test_a_group_swapped_out_after_its_drafts_were_allocated_comes_back_exact():
    """n = 2: sample 0's drafts get their slots, sample 1's do not fit, so the group is
    swapped out; the slots of drafts that never ran must not travel to host and back."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(6, 4, enable_caching=True, num_host_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), kv)
    new = Seqs()
    a = _decoding(sched, new)  # 7 tokens: blocks [0, 1]
    b = new(prompt=a.prompt_token_ids, request_id=a.request_id, index=1)
    b.output_token_ids, b.num_computed_tokens = list(a.output_token_ids), a.num_computed_tokens
    sched.fork_sequence(a, b)
    a.spec_token_ids = [11, 12, 13, 14, 15]  # 12 slots: a copy of block 1 and one more
    b.spec_token_ids = list(range(20, 33))  # 20 slots: more than the pool has left
    out = sched.schedule()
    assert not out.scheduled and [[s.seq_id for s in g] for g in sched.swapped] == [[a.seq_id, b.seq_id]]
    finish_step(sched, out)
    out = sched.schedule()  # swapped back in, whole: the tables hold the 7 tokens, no more
    assert [s.seq.seq_id for s in out.scheduled] == [a.seq_id, b.seq_id]
    kv.check_invariants([a, b])
    finish_step(sched, out)
    kv.check_invariants([a, b])
