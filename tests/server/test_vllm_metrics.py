"""/metrics exports vLLM's series (`vllm:*`: names, types, labels, buckets) with figures that
match the requests made; pagedllm's Grafana dashboard (examples/prometheus_grafana/grafana/
dashboards/pagedllm.json) reads only series and labels that /metrics exports, and so do the
series vLLM's own dashboard queries (not shipped: its names below, its file when the user
downloaded it into that folder as vllm.json)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

from tests.server.helpers import MAX_MODEL_LEN, MODEL, metric, read_metrics, wait_idle

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

DASHBOARDS = (Path(__file__).resolve().parents[2] / "examples" / "prometheus_grafana" / "grafana"
              / "dashboards")
OUR_DASHBOARD = DASHBOARDS / "pagedllm.json"
VLLM_DASHBOARD = DASHBOARDS / "vllm.json"  # downloaded by the user (README.md), git-ignored

# The series names vLLM's Grafana dashboard queries (vLLM's metric API, names only), as read
# from examples/observability/prometheus_grafana/grafana.json of vllm-project/vllm at commit
# 4b5c627c23e6690b8987100d1cbf78e34ac14bf9.
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_count",
    "vllm:inter_token_latency_seconds_sum", "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
    "vllm:request_decode_time_seconds_sum", "vllm:request_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prompt_tokens_bucket", "vllm:request_queue_time_seconds_sum",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
)

# Names a dashboard queries that pagedllm cannot measure, with the reason (also in the
# folder's README.md and docs/metrics.md). vLLM's dashboard at that commit queries none such.
NOT_EXPORTED: dict[str, str] = {}

# What pagedllm's dashboard must chart: a word of each panel's title.
OUR_PANELS = ("Requests", "KV cache", "Preemptions", "Token throughput", "reason",
              "engine step", "first token", "Inter-token", "End-to-end", "phases",
              "Prefix cache")

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
    # No figure is exported twice: pagedllm's own names are only for what vLLM lacks.
    vllm_names = {name.split(":", 1)[1] for name, _ in after if name.startswith("vllm:")}
    assert not {name for name, _ in after if name.startswith("pagedllm:") and name.split(":", 1)[1] in vllm_names}
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


def _dashboard_exprs(board: dict) -> list[tuple[str, str]]:
    """Every PromQL expression of a dashboard's panels and query variables: [(where, expr)]."""
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


_SERIES = re.compile(r"vllm:[A-Za-z0-9_:]+")
_MATCHERS = re.compile(r"(vllm:[A-Za-z0-9_:]+)\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*(vllm:[A-Za-z0-9_:]+)[^,]*,\s*(\w+)\s*\)")


def _reads(expr: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The series an expression reads, and the (series, label) pairs it needs: the labels its
    selectors match on, its by(...)/without(...) keep, and label_values(series, label) lists.
    A grouping label is needed on every series of the expression."""
    series = set(_SERIES.findall(expr))
    labels: set[tuple[str, str]] = set()
    for name, body in _MATCHERS.findall(expr):
        labels |= {(name, label) for label in _MATCHER_LABEL.findall(body)}
    for group in _GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            labels |= {(name, label) for name in series}
    labels |= set(_LABEL_VALUES.findall(expr))
    return series, labels


def _dashboard_reads(board: dict) -> tuple[dict[str, list[str]], dict[tuple[str, str], list[str]]]:
    """{series: [where]} and {(series, label): [where]} over all of a dashboard's expressions."""
    series: dict[str, list[str]] = {}
    labels: dict[tuple[str, str], list[str]] = {}
    for where, expr in _dashboard_exprs(board):
        names, pairs = _reads(expr)
        for name in names:
            series.setdefault(name, []).append(where)
        for pair in pairs:
            labels.setdefault(pair, []).append(where)
    return series, labels


def _check_against_metrics(board: dict, values: dict) -> dict[str, list[str]]:
    """Assert every series and label the dashboard reads is in /metrics; returns its series."""
    series, labels = _dashboard_reads(board)
    exported = {name for name, _ in values}
    missing = {n: w for n, w in series.items() if n not in exported and n not in NOT_EXPORTED}
    assert not missing, f"the dashboard queries series /metrics lacks: {missing}"
    on = {(name, label) for name, labels_ in values for label, _ in labels_}
    lacking = {p: w for p, w in labels.items() if p not in on and p[0] not in NOT_EXPORTED}
    assert not lacking, f"the dashboard reads labels the series lack: {lacking}"
    return series


def test_our_dashboard_is_a_grafana_model_with_the_panels():
    """No server needed: the file parses, its data source is a variable, it charts it all."""
    board = json.loads(OUR_DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert '$model_name' in target["expr"], (panel["title"], target["expr"])
    titles = " | ".join(p["title"] for p in panels)
    for word in OUR_PANELS:
        assert word in titles, word
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    series, labels = _dashboard_reads(board)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
                 "vllm:request_decode_time_seconds_sum", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                 "vllm:prefix_cache_queries_total", "vllm:iteration_tokens_total_bucket"):
        assert name in series, name
    assert ("vllm:request_success_total", "finished_reason") in labels
    quantiles = {(w, q) for w, e in _dashboard_exprs(board)
                 for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)}
    for title in ("Time to first token", "Inter-token latency", "End-to-end request latency"):
        assert {q for w, q in quantiles if w == title} == {"0.5", "0.95", "0.99"}, title


def test_our_dashboard_reads_only_exported_series_and_labels(http, traffic):
    values = read_metrics(http)
    series = _check_against_metrics(json.loads(OUR_DASHBOARD.read_text()), values)
    assert len(series) >= 15
    # Its $model_name variable reads the model_name label off those series.
    assert all(("model_name", MODEL) in labels for name, labels in values if name in series)


def test_the_series_vllms_dashboard_queries_are_exported(http, traffic):
    exported = {name for name, _ in read_metrics(http)}
    assert len(VLLM_DASHBOARD_SERIES) == len(set(VLLM_DASHBOARD_SERIES)) == 21
    missing = [n for n in VLLM_DASHBOARD_SERIES if n not in exported and n not in NOT_EXPORTED]
    assert not missing, f"/metrics lacks series vLLM's dashboard queries: {missing}"
    assert set(NOT_EXPORTED) <= set(VLLM_DASHBOARD_SERIES)  # no stale exceptions


def test_a_downloaded_vllm_dashboard_reads_only_exported_series(http, traffic):
    if not VLLM_DASHBOARD.exists():
        pytest.skip(f"{VLLM_DASHBOARD} not downloaded (examples/prometheus_grafana/README.md)")
    values = read_metrics(http)
    series = _check_against_metrics(json.loads(VLLM_DASHBOARD.read_text()), values)
    assert len(series) >= 15  # the dashboard parsed: it charts vLLM's main series
