"""Helpers of the server tests: ports, the /metrics parser, waiting for an idle engine."""

from __future__ import annotations

import socket
import time

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(http_client) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed with prometheus-client's parser: {(sample, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = http_client.get("/metrics")
    assert resp.status_code == 200, resp.text
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items())))
    return values[key]


def wait_idle(http_client, timeout: float = 20.0) -> dict:
    """Poll /metrics until no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(http_client)
        idle = (metric(m, "vllm:num_requests_running") == 0
                and metric(m, "vllm:num_requests_waiting") == 0
                and metric(m, "pagedllm:num_requests_swapped") == 0
                and metric(m, "pagedllm:kv_cache_used_blocks") == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
