"""`pagedllm serve --data-parallel-size 2 --distributed-executor-backend ray`: the two engine
cores are Ray actors (one placement-group bundle each) of a local Ray cluster started by the
server (`ray.init()` with this machine's 2 CPUs); both serve, over TCP, and greedy output equals
the one-process server's."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MODEL, read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

pytest.importorskip("ray")


def _complete(srv, prompt: str) -> str:
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_ray_placed_replicas_serve_and_equal_one_process(server, tmp_path):
    prompts = [f"Fact {i}: the sun" for i in range(4)]
    reference = [_complete(server, p) for p in prompts]
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--data-parallel-size", "2",
                  "--distributed-executor-backend", "ray", "--kv-cache-space", "0.25",
                  "--max-model-len", "1024"], cwd=str(tmp_path)) as srv:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: _complete(srv, p), prompts)) == reference
        with httpx.Client(base_url=srv.url, headers=srv.headers) as http:
            m = read_metrics(http)
        for engine in ("0", "1"):
            key = ("vllm:generation_tokens_total",
                   (("engine", engine), ("model_name", MODEL)))
            assert m[key] >= 16, (engine, m.get(key))
        assert "Ray actor" not in srv.log_tail() or "died" not in srv.log_tail()
