"""One request never takes the whole server (issue 23), against real `pagedllm serve`
processes: hostile bodies, heads, prompts, chat templates and schemas; after each, a plain
request is served and /health is 200.

The shared server (conftest: default limits, request templates untrusted) takes the body and
prompt cases; a second one with 1 s head / body / render timeouts and
--trust-request-chat-template the slow clients and the runaway template, then a SIGTERM drain
with slow clients still connected.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow

HOSTILE_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}x")
MESSAGES = [{"role": "user", "content": "Say hi"}]
TIMEOUT_S = 1.0  # the limited server's head, body and render timeouts
LIMITED = ["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25",
           "--max-model-len", "1024", "--request-header-timeout", str(TIMEOUT_S),
           "--request-body-timeout", str(TIMEOUT_S), "--trust-request-chat-template",
           "--chat-template-render-timeout", str(TIMEOUT_S)]


@pytest.fixture(scope="module")
def limited():
    with serving(LIMITED) as srv:
        yield srv


def completion(srv, timeout: float = 60.0, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **body}
    return httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, json=body,
                      timeout=timeout)


def chat(srv, timeout: float = 60.0, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **body}
    return httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers, json=body,
                      timeout=timeout)


def assert_still_serving(srv) -> None:
    t0 = time.monotonic()
    r = completion(srv)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 10
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == status
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


class Timed(threading.Thread):
    """Runs `fn` in the background; `.result` and `.seconds` once joined."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.seconds = fn, None, None

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = self.fn()
        except Exception as exc:  # reported by the test's assertion on .result
            self.result = exc
        self.seconds = time.monotonic() - t0


# ---- bodies and prompts (the shared server) ---------------------------------------------------


def test_an_oversized_body_is_refused_at_once_and_delays_no_one(server):
    """10.8 MB: was a 400 after 11-12 s of tokenizing, with every request behind it waiting."""
    body = json.dumps({"model": MODEL, "prompt": "hello world " * 900_000,
                       "max_tokens": 1}).encode()
    assert len(body) > 10_000_000
    big = Timed(lambda: httpx.post(
        f"{server.url}/v1/completions", content=body, timeout=120,
        headers={**server.headers, "content-type": "application/json"}))
    big.start()
    time.sleep(0.2)
    small = Timed(lambda: completion(server))
    small.start()
    big.join(120)
    small.join(120)
    assert_error(big.result, 413, "--max-request-body-bytes", "8388608")
    assert big.seconds < 3.0
    assert small.result.status_code == 200 and small.seconds < 3.0
    assert_still_serving(server)


def test_a_chunked_body_is_refused_once_past_the_limit(server):
    parts = iter([b'{"model": "%s", "max_tokens": 1, "prompt": "' % MODEL.encode()]
                 + [b"hello world " * 5_000] * 150 + [b'"}'])  # 9 MB, Transfer-Encoding: chunked
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", content=parts, timeout=120,
                   headers={**server.headers, "content-type": "application/json"})
    assert_error(r, 413, "more than 8388608 bytes")
    assert time.monotonic() - t0 < 3.0
    assert_still_serving(server)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server, endpoint):
    """4.2 MB of text (under the body limit): refused from its length, not after seconds of
    tokenizing."""
    text = "hello world " * 350_000
    t0 = time.monotonic()
    if endpoint == "completions":
        r = completion(server, prompt=text)
    else:
        r = chat(server, messages=[{"role": "user", "content": text}])
    assert_error(r, 400, "maximum context length is 2048 tokens", "characters")
    assert time.monotonic() - t0 < 2.0
    assert_still_serving(server)


def test_head_health_answers_like_get(server):
    r = httpx.head(f"{server.url}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


def test_a_request_chat_template_is_refused_without_the_flag(server, http):
    """The runaway template used to run in the front end for ever; every later request hung."""
    r = chat(server, timeout=10, chat_template=HOSTILE_TEMPLATE)
    assert_error(r, 400, "chat_template", "--trust-request-chat-template")
    r = chat(server, timeout=10, chat_template_kwargs={"chat_template": HOSTILE_TEMPLATE})
    assert_error(r, 400, "chat_template_kwargs.chat_template")
    r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": HOSTILE_TEMPLATE},
                  timeout=10)
    assert_error(r, 400, "--trust-request-chat-template")
    assert chat(server).status_code == 200  # the server's own template is untouched
    assert_still_serving(server)


def test_deeply_nested_schemas_are_a_400(server):
    """5,000 levels: as a JSON string it was a 500 (RecursionError)."""
    deep = '{"type":"array","items":' * 5000 + '{"type":"string"}' + "}" * 5000
    as_string = [
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": deep}}},
        {"structured_outputs": {"json": deep}},
    ]
    for extra in as_string:
        assert_error(chat(server, **extra), 400, "nested too deeply")
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,'
           ' "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
           '"schema": %s}}}' % (MODEL, deep))
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw, timeout=60,
                   headers={**server.headers, "content-type": "application/json"})
    assert_error(r, 400)  # json.loads of the body stops at Python's recursion limit
    assert_still_serving(server)


def test_a_non_positive_body_limit_is_refused_at_start_up():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                           "--max-request-body-bytes", "0", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--max-request-body-bytes must be a positive number of bytes, got 0" in proc.stderr
    assert time.monotonic() - t0 < 60  # before any model loads


# ---- slow clients, runaway templates, drain (the limited server) ------------------------------


def open_slow_heads(srv, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection((srv.host, srv.port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def open_slow_bodies(srv, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection((srv.host, srv.port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + srv.api_key.encode() + b"\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        socks.append(s)
    return socks


def drip_until_closed(socks: list[socket.socket], limit_s: float) -> dict[int, tuple]:
    """Send a byte to each socket every 0.1 s (a slowloris) until the server closes it:
    {index: (seconds, the first bytes the server sent, or "reset")}. A close with dripped
    bytes still unread is a TCP reset, which may come before the 408 is read."""
    for s in socks:
        s.setblocking(False)
    t0 = time.monotonic()
    closed: dict[int, tuple] = {}
    while len(closed) < len(socks) and time.monotonic() - t0 < limit_s:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"a")
                data = s.recv(65536)
                closed[i] = (time.monotonic() - t0, data[:12])
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                closed[i] = (time.monotonic() - t0, "reset")
        time.sleep(0.1)
    return closed


def test_slow_heads_are_closed_in_time_and_others_served_meanwhile(limited):
    socks = open_slow_heads(limited, 20)
    served = Timed(lambda: completion(limited))
    served.start()
    closed = drip_until_closed(socks, limit_s=10)
    served.join(60)
    for s in socks:
        s.close()
    assert len(closed) == 20, closed
    assert max(t for t, _ in closed.values()) < TIMEOUT_S + 1.5
    assert all(first in (b"HTTP/1.1 408", "reset") for _, first in closed.values()), closed
    assert served.result.status_code == 200 and served.seconds < 5
    assert_still_serving(limited)


def test_a_slow_body_gets_a_408(limited):
    socks = open_slow_bodies(limited, 5)
    closed = drip_until_closed(socks, limit_s=10)
    for s in socks:
        s.close()
    assert len(closed) == 5, closed
    assert max(t for t, _ in closed.values()) < TIMEOUT_S + 1.5
    assert all(first in (b"HTTP/1.1 408", "reset") for _, first in closed.values()), closed
    assert_still_serving(limited)


def test_a_trusted_runaway_template_is_stopped_past_the_render_timeout(limited):
    t0 = time.monotonic()
    r = chat(limited, timeout=30, chat_template=HOSTILE_TEMPLATE)
    assert_error(r, 400, "--chat-template-render-timeout")
    assert time.monotonic() - t0 < TIMEOUT_S + 3
    t0 = time.monotonic()
    assert chat(limited).status_code == 200  # nothing left rendering in the tokenizer thread
    assert time.monotonic() - t0 < 5
    own = chat(limited, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert own.status_code == 200, own.text  # trusted: a request's template is used
    assert own.json()["usage"]["prompt_tokens"] <= 3
    assert_still_serving(limited)


def test_a_sigterm_drain_is_not_held_by_slow_clients(limited):
    """Last on this server. Slow bodies counted as in flight and held the drain for its
    whole --drain-timeout (30 s); slow heads never reach the app."""
    socks = open_slow_heads(limited, 10) + open_slow_bodies(limited, 10)
    dripper = Timed(lambda: drip_until_closed(socks, limit_s=40))
    dripper.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    limited.proc.terminate()
    assert limited.proc.wait(timeout=60) == 0, limited.log_tail()
    exited = time.monotonic() - t0
    dripper.join(60)
    for s in socks:
        s.close()
    assert exited < TIMEOUT_S + 4, exited
    assert len(dripper.result) == 20
