"""A heavy grammar never stops the other requests (issue 23): a JSON schema `enum` of 100,000
strings (a 1.4 MB body) used to compile inside the core's intake for over 5 minutes at 100% of
both cores while every other request timed out, and the client's disconnect did not stop it.

Now the constraint compiles in the core's compiler process: a stream already running keeps
receiving tokens meanwhile, the heavy request fails with a 400 after
`--structured-outputs-timeout`, and a plain request and a normal JSON-mode request succeed
right after.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def srv():
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.1",
                  "--max-model-len", "512", "--structured-outputs-timeout",
                  str(TIMEOUT_S)]) as s:
        yield s


def _chat(srv, extra: dict, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers, json=body,
                      timeout=timeout)


def test_a_huge_enum_fails_after_the_timeout_while_a_stream_goes_on(srv):
    # warm the compiler process (its first start imports xgrammar, about 3 s)
    assert _chat(srv, {"response_format": {"type": "json_object"}}).status_code == 200
    stamps: list[float] = []
    started, enough = threading.Event(), threading.Event()

    def stream() -> None:  # the context's length (512): longer than the compile; left early
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "stream": True,
                "max_tokens": 480, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{srv.url}/v1/completions", headers=srv.headers,
                          json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.monotonic())
                    started.set()
                if enough.is_set():
                    return  # the client leaves: the server aborts the request

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60)
    enum = [f"value-{i:06d}" for i in range(100_000)]
    schema = {"type": "object", "properties": {"v": {"enum": enum}}, "required": ["v"]}
    t0 = time.monotonic()
    r = _chat(srv, {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "big", "schema": schema}}})
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert "--structured-outputs-timeout" in r.json()["error"]["message"]
    assert took < TIMEOUT_S + 15, took
    enough.set()
    # The stream went on all through the compile: events from its start to its end (a slow
    # step folds several tokens into one event, so count the gaps, not the events).
    during = [s for s in stamps if t0 <= s <= t0 + took]
    gaps = [b - a for a, b in zip([t0, *during], [*during, t0 + took])]
    assert len(during) >= 3 and max(gaps) < 2.0, (len(during), max(gaps))
    reader.join(120)
    plain = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=10,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert plain.status_code == 200
    ok = _chat(srv, {"response_format": {"type": "json_object"}})
    assert ok.status_code == 200
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
