"""/metrics exports vLLM's series (`vllm:*`: names, types, labels, buckets) with figures that
match the requests made, and vLLM's published Grafana dashboard (examples/prometheus_grafana/
grafana.json, shipped unchanged) queries only series that /metrics exports."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

from tests.server.helpers import MAX_MODEL_LEN, MODEL, metric, read_metrics, wait_idle

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "prometheus_grafana" / "grafana.json"

# Names the dashboard queries that pagedllm cannot measure, with the reason (also in the
# folder's README.md and docs/metrics.md). vLLM's current dashboard queries none such.
NOT_EXPORTED: dict[str, str] = {}

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info")
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:prompt_tokens_cached")
PER_REQUEST = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
               "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
               "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
               "vllm:request_max_num_generation_tokens",
               "vllm:request_prefill_kv_computed_tokens",
               "vllm:request_time_per_output_token_seconds")
PER_TOKEN = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
HISTOGRAMS = PER_REQUEST + PER_TOKEN + ("vllm:iteration_tokens_total",)
# vLLM's bucket edges (vllm/v1/metrics/buckets.py)
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                         160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                         0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                         20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                                         960.0, 1920.0, 7680.0],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
}


def _families(http) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    resp = http.get("/metrics")
    assert resp.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


@pytest.fixture(scope="module")
def traffic(http, client):
    """Three completions (6, 4 and 1 tokens) on prompts no cache holds; /metrics around them."""
    before = wait_idle(http)
    tokens = (6, 4, 1)
    usages = []
    for n in tokens:
        # A fresh first word: no prefix cache hit, so every prompt token is prefilled.
        out = client.completions.create(model=MODEL, prompt=f"{uuid.uuid4().hex} counts to ten:",
                                        max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == n
        usages.append(out.usage)
    after = wait_idle(http)
    return before, after, tokens, usages


def test_every_vllm_name_has_its_type_and_labels(http, traffic):
    families = _families(http)
    kinds = {**{n: "gauge" for n in GAUGES}, **{n: "counter" for n in COUNTERS},
             **{n: "histogram" for n in HISTOGRAMS}}
    for name, kind in kinds.items():
        assert name in families, f"{name} is not exported"
        family = families[name]
        assert family.type == kind, (name, family.type)
        for s in family.samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", (name, s)
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons >= {"stop", "length", "abort"}
    for name, edges in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]
        assert [float(x) for x in les[:-1]] == [float(x) for x in edges] and les[-1] == "+Inf"
    info = [s for s in families["vllm:cache_config_info"].samples]
    assert len(info) == 1 and info[0].value == 1
    labels = info[0].labels
    assert int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0
    assert int(labels["kv_cache_size_tokens"]) == int(labels["block_size"]) * int(
        labels["num_gpu_blocks"])
    assert labels["enable_prefix_caching"] in ("True", "False")
    assert max(VLLM_BUCKETS["vllm:request_prompt_tokens"]) <= MAX_MODEL_LEN


def test_vllm_figures_count_the_requests(traffic):
    before, after, tokens, usages = traffic

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(tokens)
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:request_success_total", finished_reason="length") == len(tokens)
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:prefix_cache_queries_total") >= prompt
    assert delta("vllm:prefix_cache_hits_total") == 0  # fresh prompts
    assert delta("vllm:prompt_tokens_cached_total") == 0
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == prompt
    # The same figures under pagedllm's names.
    assert delta("pagedllm:generation_tokens_total") == generated
    for name in PER_REQUEST:
        assert delta(f"{name}_count") == len(tokens), name
    for name in PER_TOKEN:  # one gap per token after the first, one step each
        assert delta(f"{name}_count") == sum(n - 1 for n in tokens), name
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_max_num_generation_tokens_sum") == generated  # n=1
    # Each step feeds the prompt once, then each sampled token but the last.
    assert delta("vllm:iteration_tokens_total_sum") == prompt + sum(n - 1 for n in tokens)
    assert delta("vllm:iteration_tokens_total_count") == len(tokens) + sum(n - 1 for n in tokens)
    # Time: the phases add up to the request's life; a one-token request decodes for 0 s.
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    parts = (delta("vllm:request_queue_time_seconds_sum")
             + delta("vllm:request_prefill_time_seconds_sum")
             + delta("vllm:request_decode_time_seconds_sum"))
    assert 0 < parts <= e2e + 1e-6
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum")
        + delta("vllm:request_decode_time_seconds_sum"), abs=1e-6)
    assert delta("vllm:time_to_first_token_seconds_sum") <= e2e + 1e-6
    assert delta("vllm:request_time_per_output_token_seconds_bucket", le="0.01") >= 1  # the 0
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0


def _dashboard_exprs() -> list[tuple[str, str]]:
    """Every PromQL expression of the dashboard's panels and variables: [(where, expr)]."""
    board = json.loads(DASHBOARD.read_text())
    exprs: list[tuple[str, str]] = []

    def walk(panels: list) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    exprs.append((panel.get("title", ""), target["expr"]))
            walk(panel.get("panels", []))  # rows

    walk(board["panels"])
    for var in board.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query" and query:
            exprs.append((f"variable {var['name']}", query))
    return exprs


def _dashboard_series() -> dict[str, list[str]]:
    """Every series name a PromQL expression of the dashboard reads: {name: [panel titles]}."""
    names: dict[str, list[str]] = {}
    for title, expr in _dashboard_exprs():
        for name in re.findall(r"vllm:[A-Za-z0-9_:]+", expr):
            names.setdefault(name, []).append(title)
    return names


def test_the_shipped_dashboard_queries_only_exported_series(http, traffic):
    series = _dashboard_series()
    assert len(series) >= 15  # the dashboard parsed: it charts vLLM's main series
    exported = {name for name, _ in read_metrics(http)}
    missing = {n: titles for n, titles in series.items()
               if n not in exported and n not in NOT_EXPORTED}
    assert not missing, f"the dashboard queries series /metrics lacks: {missing}"
    # Its $model_name variable reads the model_name label off those series.
    labelled = {labels for (name, labels) in read_metrics(http) if name in series}
    assert all(("model_name", MODEL) in labels for labels in labelled)
    assert set(NOT_EXPORTED) <= set(series)  # no stale exceptions
    # The labels its `sum by(...)` keep (le, finished_reason) are on the series it sums.
    values = read_metrics(http)
    for title, expr in _dashboard_exprs():
        for label in re.findall(r"by\s*\((\w+)\)", expr):
            for name in re.findall(r"vllm:[A-Za-z0-9_:]+", expr):
                if name in NOT_EXPORTED:
                    continue
                assert any(n == name and label in dict(labels) for n, labels in values), (
                    title, name, label)
