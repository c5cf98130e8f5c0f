"""The long-context regime (`SchedulerConfig.long_context_after`, Phi-3 LongRoPE): a sequence is
in it from its first token when longer than the limit, is recomputed whole (once) when it grows
past it, and blocks of the two regimes never match in the prefix cache."""

import pytest

from pagedllm.core.scheduler_config import SchedulerConfig
from tests.unit.test_scheduler import Seqs, finish_step, make_scheduler, plan


def test_a_sequence_growing_past_the_limit_is_recomputed_once():
    sched, kv = make_scheduler(block_size=4, long_context_after=10)
    new = Seqs()
    a = new(8)
    sched.add_sequence(a)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 0, 8, True)] and not a.long_context
    assert out.scheduled[0].seq_len == 8
    finish_step(sched, out)  # 9 tokens
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 8, 1, True)]
    finish_step(sched, out)  # 10 tokens: still short (at most the limit)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 9, 1, True)]
    finish_step(sched, out)  # 11 tokens > 10: recomputed from token 0, in the long regime
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 0, 11, True)] and a.long_context
    assert out.scheduled[0].seq_len == 11 and out.preempted == []
    assert sched.num_long_context_recomputes == 1 and sched.num_preemptions == 0
    finish_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 11, 1, True)]  # no second recompute
    assert sched.num_long_context_recomputes == 1
    kv.check_invariants([a])


def test_a_long_prompt_starts_in_the_long_regime_and_other_sequences_go_on():
    sched, kv = make_scheduler(block_size=4, long_context_after=10)
    new = Seqs()
    short, long = new(10), new(12)
    sched.add_sequence(short)
    sched.add_sequence(long)
    out = sched.schedule()
    assert plan(out) == [(short.seq_id, 0, 10, True), (long.seq_id, 0, 12, True)]
    assert not short.long_context and long.long_context
    finish_step(sched, out)
    out = sched.schedule()  # `short` crossed (11 tokens): recomputed; `long` decodes in the same step
    assert plan(out) == [(long.seq_id, 12, 1, True), (short.seq_id, 0, 11, True)]
    assert sched.num_long_context_recomputes == 1
    kv.check_invariants([short, long])


def test_prefix_cache_never_mixes_regimes():
    sched, kv = make_scheduler(block_size=4, long_context_after=10)
    new = Seqs()
    prompt = list(range(100, 112))
    first = new(prompt=prompt[:9])  # short regime: its two full blocks are cached as short
    sched.add_sequence(first)
    out = sched.schedule()
    finish_step(sched, out)
    sched.finish_sequence(first, first.status.FINISHED_STOPPED)
    same_short = new(prompt=prompt[:9])
    sched.add_sequence(same_short)
    out = sched.schedule()
    assert plan(out) == [(same_short.seq_id, 8, 1, True)]  # hits both blocks
    finish_step(sched, out)
    sched.finish_sequence(same_short, same_short.status.FINISHED_STOPPED)
    longer = new(prompt=prompt)  # the same first 8 tokens, long regime: no hit
    sched.add_sequence(longer)
    out = sched.schedule()
    assert plan(out) == [(longer.seq_id, 0, 12, True)] and longer.long_context


def test_limit_is_validated():
    with pytest.raises(ValueError, match="long_context_after must be at least 1"):
        SchedulerConfig(long_context_after=0)
