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


def test_a_sample_swapped_out_after_its_drafts_got_slots_keeps_only_its_tokens_blocks():
    """Two samples of one request: the first gets slots for its drafts, the second finds no
    block and swaps the pair out in the same step. The drafts will not run: their block goes
    back before the swap (else the swapped table outgrows the sequence)."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_config import SchedulerConfig

    kv = KVCacheManager(5, 4, enable_caching=False, num_host_blocks=16)
    sched = Scheduler(SchedulerConfig(preemption_mode="swap", max_num_batched_tokens=32), kv)
    new = Seqs()
    a, b = new(6, request_id="r", index=0), new(8, request_id="r", index=1)
    for s in (a, b):
        sched.add_sequence(s)
    finish_step(sched, sched.schedule(), token=70)  # a: 7 tokens (2 blocks), b: 9 (2 blocks + 1 next)
    assert kv.num_free_blocks == 1
    a.spec_token_ids = [11, 12, 13]  # positions 6..9: a third block
    out = sched.schedule()
    assert [s.seq_id for s in out.scheduled] == [] and set(out.preempted) == {a.seq_id, b.seq_id}
    assert a.status == SequenceStatus.SWAPPED and a.spec_token_ids == []
    assert len(kv.host_tables[0][a.seq_id]) == 2  # not 3
    kv.check_invariants([a, b])
    sched.update_after_step(out)
