"""vLLM's speculative-decoding counters from the core's cumulative CoreStats (increments only)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.core_messages import CoreStats
from pagedllm.metrics import EngineMetrics


def _samples(m: EngineMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_spec_decode_counters_follow_the_core():
    m = EngineMetrics("m", kernel_info={})
    m.update_from_stats(CoreStats(spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                                  spec_accepted_per_pos=[3, 2, 2, 0]))
    m.update_from_stats(CoreStats(spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=9,
                                  spec_accepted_per_pos=[5, 2, 2, 0]))
    s = _samples(m)
    base = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:spec_decode_num_drafts_total", base)] == 5
    assert s[("vllm:spec_decode_num_draft_tokens_total", base)] == 20
    assert s[("vllm:spec_decode_num_accepted_tokens_total", base)] == 9
    per_pos = {dict(k[1])["position"]: v for k, v in s.items()
               if k[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 5.0, "1": 2.0, "2": 2.0}


def test_the_periodic_log_line_has_the_acceptance_figures():
    from pagedllm.engine.stat_logger import PeriodicStatLogger

    log = PeriodicStatLogger(interval_s=10)
    assert log.observe(CoreStats(kv_num_blocks=10), now=0.0) is None
    mid = CoreStats(kv_used_blocks=5, kv_num_blocks=10, num_running=2, iteration_tokens=[30, 20],
                    prefix_cache_queries=100, prefix_cache_hits=25, spec_num_drafts=4,
                    spec_num_draft_tokens=16, spec_num_accepted_tokens=6, spec_accepted_per_pos=[3, 2, 1, 0])
    assert log.observe(mid, now=5.0) is None  # within the interval
    line = log.observe(CoreStats(kv_num_blocks=10, spec_num_drafts=4, spec_num_draft_tokens=16,
                                 spec_num_accepted_tokens=6, spec_accepted_per_pos=[3, 2, 1, 0],
                                 prefix_cache_queries=100, prefix_cache_hits=25), now=10.0)
    assert "Avg throughput: 5.0 tokens/s" in line and "Prefix cache hit rate: 25.0%" in line
    assert "Mean acceptance length: 2.50" in line and "Avg Draft acceptance rate: 37.5%" in line
    assert "Per-position acceptance rate: 0.750, 0.500, 0.250, 0.000" in line
