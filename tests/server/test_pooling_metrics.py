"""A pooling model's server is the one engine's server: a real `pagedllm serve` of a tiny
decoder embedder (Qwen3Model), the official openai client. Its embedding requests count in the
vLLM-named series of /metrics (success, prompt tokens, end-to-end latency; nothing left running
or holding a KV block), the dashboard's snapshot answers, and hostile values are 4xx that leave
the engine serving the next plain request."""

from __future__ import annotations

import time

import pytest

from tests.integration.pooling_fixtures import save_decoder_embedder
from tests.server.conftest import serving
from tests.server.helpers import read_metrics

pytestmark = pytest.mark.slow  # starts a server

NAME = "tiny-embed-metrics"
MAX_LEN = 64


@pytest.fixture(scope="module")
def pooled_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-metrics")
    save_decoder_embedder(path, "qwen3", seed=5)
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", str(path), "--served-model-name", NAME,
                  "--max-model-len", str(MAX_LEN), "--num-kv-blocks", "64", "--block-size", "8"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(pooled_server):
    import httpx
    import openai

    with httpx.Client(base_url=pooled_server.url, headers=pooled_server.headers, timeout=60.0) as http:
        yield openai.OpenAI(base_url=f"{pooled_server.url}/v1", api_key=pooled_server.api_key, max_retries=0,
                            timeout=60.0), http


def _value(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted({"model_name": NAME, "engine": "0", **labels}.items()))), 0.0)


def _idle_metrics(http, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(http)
        if (_value(m, "vllm:num_requests_running") == 0 and _value(m, "pagedllm:kv_cache_used_blocks") == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_embeddings_count_in_metrics_and_dashboard_answers(clients):
    client, http = clients
    before = _idle_metrics(http)
    out = client.embeddings.create(model=NAME, input=["the cat", "a dog and a tree"], encoding_format="float")
    assert len(out.data) == 2 and out.usage.prompt_tokens > 0
    after = _idle_metrics(http)
    assert _value(after, "vllm:request_success_total", finished_reason="stop") \
        - _value(before, "vllm:request_success_total", finished_reason="stop") == 2
    assert _value(after, "vllm:prompt_tokens_total") - _value(before, "vllm:prompt_tokens_total") \
        == out.usage.prompt_tokens
    assert _value(after, "vllm:e2e_request_latency_seconds_count") \
        - _value(before, "vllm:e2e_request_latency_seconds_count") == 2
    assert _value(after, "vllm:num_requests_running") == 0  # the series exists and the requests left
    assert _value(after, "pagedllm:kv_cache_used_blocks") == 0  # their blocks went back
    snap = http.get("/v1/internal/engine_state")
    assert snap.status_code == 200, snap.text
    state = snap.json()
    assert "engines" in state or "num_blocks" in str(state), state
    assert http.get("/dashboard").status_code == 200


@pytest.mark.parametrize("body, status", [
    ({"input": "the cat", "dimensions": 0}, 400),
    ({"input": "the cat", "dimensions": -3}, 400),
    ({"input": "the cat", "dimensions": 10**9}, 400),
    ({"input": "the cat", "dimensions": "wide"}, 400),
    ({"input": [[]]}, 400),
    ({"input": []}, 400),
    ({"input": "paris " * 50_000}, 400),
    ({"input": ["ok", "paris " * 200]}, 400),
    ({"input": [[1, 10**9]]}, 400),
])
def test_hostile_values_are_4xx_and_a_plain_request_succeeds_after(clients, body, status):
    client, http = clients
    r = http.post("/v1/embeddings", json={"model": NAME, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"], r.text
    ok = client.embeddings.create(model=NAME, input="a plain request", encoding_format="float")
    assert len(ok.data[0].embedding) == 64
    m = _idle_metrics(http)
    assert _value(m, "pagedllm:kv_cache_used_blocks") == 0
