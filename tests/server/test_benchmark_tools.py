"""The online benchmark tools against the real server (tiny workload; no timing asserted)."""

from __future__ import annotations

import pytest
from benchmarks import serving, throughput
from benchmarks.workloads import load_workload

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def test_serving_benchmark_rates_and_plots(server, tmp_path):
    rows = serving.main(["--base-url", server.url, "--api-key", server.api_key,
                         "--workload", "tiny", "--request-rate", "inf,20",
                         "--max-concurrency", "2", "--plot", str(tmp_path)])
    expected = sum(r.max_tokens for r in load_workload("tiny", 49152))
    assert [r["request_rate"] for r in rows] == ["inf", 20.0]
    for row in rows:
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["output_tokens"] == expected
        assert row["ttft_ms"]["median"] > 0 and row["e2e_ms"]["p99"] >= row["e2e_ms"]["median"]
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 0
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_throughput_against_openai_server(server):
    [res] = throughput.main(["--backend", "llamacpp", "--base-url", server.url, "--api-key",
                             server.api_key, "--workload", "tiny"])
    assert res["output_tokens"] == sum(r.max_tokens for r in load_workload("tiny", 49152))

