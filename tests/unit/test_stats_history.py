"""engine/stats_history.py: one sample a second per engine core from the CoreStats stream,
step tokens of every message counted, a ring of the last minutes."""

from __future__ import annotations

from pagedllm.engine.core_messages import CoreStats
from pagedllm.engine.stats_history import StatsHistory


def test_one_sample_per_interval_with_every_steps_tokens_and_a_bounded_ring():
    h = StatsHistory(interval_s=1.0, span_s=3.0)
    reads = []

    def gen() -> float:
        reads.append(1)
        return 7.0

    assert h.observe(CoreStats(num_running=1, kv_used_blocks=2, iteration_tokens=[5]), 0, 10.0, gen)
    assert not h.observe(CoreStats(num_running=2, iteration_tokens=[3, 4]), 0, 10.5, gen)
    assert h.observe(CoreStats(num_running=3, iteration_tokens=[1]), 0, 11.0, gen)
    assert len(reads) == 2  # the counter is read only for a kept sample
    samples = h.samples(0)
    assert [s["t"] for s in samples] == [10.0, 11.0]
    assert [s["num_batched_tokens_total"] for s in samples] == [5, 13]  # 10.5's tokens counted
    assert samples[0]["kv_used_blocks"] == 2 and samples[1]["num_running"] == 3
    assert samples[0]["generation_tokens_total"] == 7.0
    for t in (12.0, 13.0, 14.0):
        h.observe(CoreStats(), 0, t)
    assert [s["t"] for s in h.samples(0)] == [12.0, 13.0, 14.0]  # three seconds kept
    assert h.samples(1) == [] and h.samples(0)[-1]["generation_tokens_total"] is None
    h.observe(CoreStats(num_waiting=4), 1, 14.2)  # each core its own clock and ring
    assert h.samples(1)[0]["num_waiting"] == 4 and len(h.samples(0)) == 3
