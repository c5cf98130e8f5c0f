"""`pagedllm serve --data-parallel-size 2`: two engine cores behind one API server.

Both replicas serve (by load); requests sharing a system prompt go to the same replica, whose
prefix cache then holds it (prefix affinity); `/metrics` labels each replica (`engine`);
killing one replica fails only the requests it held, and the other goes on serving.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import httpx
import openai
import psutil
import pytest

from tests.server.conftest import serving
from tests.server.helpers import API_KEY, MODEL, read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def value(m: dict, name: str, engine: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, "engine": engine, **labels}.items())))
    return m.get(key, 0.0)


@pytest.fixture(scope="module")
def dp_server():
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--data-parallel-size", "2",
                  "--kv-cache-space", "0.25", "--max-model-len", "1024"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(dp_server):
    return openai.OpenAI(base_url=f"{dp_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120.0)


@pytest.fixture(scope="module")
def http(dp_server):
    with httpx.Client(base_url=dp_server.url, headers=dp_server.headers, timeout=120.0) as c:
        yield c


def test_both_replicas_serve(client, http):
    before = wait_idle_all(http)
    prompts = [f"Request {i}: say" for i in range(6)]  # shorter than a block: no affinity

    def one(p: str) -> int:
        return client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, prompts)) == [24] * 6
    after = wait_idle_all(http)
    for engine in ("0", "1"):
        gained = (value(after, "vllm:generation_tokens_total", engine)
                  - value(before, "vllm:generation_tokens_total", engine))
        assert gained >= 24, (engine, gained)


def test_shared_system_prompt_stays_on_one_replica_and_hits_its_prefix_cache(client, http):
    system = ("You are a meticulous assistant for a library. " * 12).strip()
    before = wait_idle_all(http)
    for i in range(4):
        client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": f"Question number {i}?"}])
    after = wait_idle_all(http)
    served = {e: value(after, "vllm:request_success_total", e, finished_reason="length")
              + value(after, "vllm:request_success_total", e, finished_reason="stop")
              - value(before, "vllm:request_success_total", e, finished_reason="length")
              - value(before, "vllm:request_success_total", e, finished_reason="stop")
              for e in ("0", "1")}
    assert sorted(served.values()) == [0, 4], served
    home = max(served, key=served.get)
    hits = (value(after, "vllm:prefix_cache_hits_total", home)
            - value(before, "vllm:prefix_cache_hits_total", home))
    assert hits >= 3 * 64, hits  # the system prompt's blocks, reused by requests 2..4
    # the dashboard's endpoint: one snapshot per replica, each equal to its /metrics series
    engines = http.get("/v1/internal/engine_state").json()["engines"]
    assert [e["engine_index"] for e in engines] == [0, 1]
    for e in engines:
        assert e["counters"]["prefix_cache_hits"] == value(after, "vllm:prefix_cache_hits_total",
                                                           str(e["engine_index"]))
        assert e["counters"]["kv_used_blocks"] == 0 and e["requests"] == []


def wait_idle_all(http) -> dict:
    import time

    deadline = time.monotonic() + 20
    while True:
        m = read_metrics(http)
        idle = all(value(m, "vllm:num_requests_running", e) == 0
                   and value(m, "pagedllm:kv_cache_used_blocks", e) == 0 for e in ("0", "1"))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


class Stream(threading.Thread):
    def __init__(self, srv, prompt: str) -> None:
        super().__init__(daemon=True)
        self.srv, self.prompt = srv, prompt
        self.payloads: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "stream": True, "max_tokens": 300,
                "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=self.srv.url, headers=self.srv.headers, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.payloads.append(line[6:])
                        self.started.set()


def test_killing_one_replica_fails_only_its_requests(dp_server, client, http):
    """Last in this module: it leaves one replica dead."""
    pids = {int(e): int(p) for e, p in
            re.findall(r"Engine core (\d+) ready in [\d.]+ s \(pid (\d+)\)", dp_server.log_tail(100000))}
    assert sorted(pids) == [0, 1], dp_server.log_tail()
    wait_idle_all(http)
    streams = [Stream(dp_server, f"Stream {i}: 1, 2,") for i in range(2)]
    for s in streams:
        s.start()
        assert s.started.wait(60)
    psutil.Process(pids[1]).kill()
    for s in streams:
        s.join(120)
    finals = [s.payloads[-2] for s in streams]
    errors = [json.loads(p).get("error") for p in finals]
    failed = [e for e in errors if e is not None]
    assert len(failed) == 1 and failed[0]["code"] == 503 and "died" in failed[0]["message"]
    ok = [json.loads(p) for p, e in zip(finals, errors) if e is None]
    assert ok[0]["choices"][0]["finish_reason"] == "length"
    health = http.get("/health")
    assert health.status_code == 503 and "1 (killed by signal 9)" in health.json()["error"]["message"]
    out = client.completions.create(model=MODEL, prompt="Still serving?", max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3  # the live replica takes every request
    engines = http.get("/v1/internal/engine_state").json()["engines"]  # the dead one named
    assert "error" not in engines[0] and "killed by signal 9" in engines[1]["error"], engines
    assert dp_server.proc.poll() is None
