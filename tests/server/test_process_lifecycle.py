"""The server's processes: the engine core runs in a child process of `pagedllm serve`.

- SIGKILL of the core mid-stream: the stream ends with a 503 error event within a second,
  /health answers 503, the server exits 1 and leaves no process behind.
- SIGTERM drains: a new request gets 503, the stream in flight finishes whole, exit 0, the
  core process is gone.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SERVE = ["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25",
         "--max-model-len", "1024"]


def core_processes(server_pid: int) -> list[psutil.Process]:
    """The engine core children of a server (not multiprocessing's resource tracker)."""
    children = psutil.Process(server_pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background: its events and when each came."""

    def __init__(self, srv, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.max_tokens = srv, max_tokens
        self.events: list[tuple[float, str]] = []
        self.started = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2, 3,", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=self.srv.url, headers=self.srv.headers, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                        self.started.set()


def test_killed_core_fails_the_stream_turns_health_503_and_exits_1():
    with serving(SERVE) as srv:
        (core,) = core_processes(srv.proc.pid)
        reader = StreamReader(srv, max_tokens=900)
        reader.start()
        assert reader.started.wait(60), srv.log_tail()
        core.kill()  # SIGKILL
        killed_at = time.monotonic()
        while True:  # /health turns 503 within a second
            health = httpx.get(f"{srv.url}/health", timeout=5)
            if health.status_code != 200 or time.monotonic() - killed_at > 1.0:
                break
            time.sleep(0.05)
        reader.join(30)
        assert not reader.is_alive()
        assert health.status_code == 503, health.text
        assert "died" in health.json()["error"]["message"]
        payloads = [p for _, p in reader.events]
        assert payloads[-1] == "[DONE]"
        err_at, err = reader.events[-2]
        err = json.loads(err)["error"]
        assert err["code"] == 503 and "died" in err["message"]
        assert err_at - killed_at < 1.0  # noticed within a second
        assert srv.proc.wait(timeout=30) == 1, srv.log_tail()


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0():
    with serving(SERVE) as srv:
        (core,) = core_processes(srv.proc.pid)
        reader = StreamReader(srv, max_tokens=120)
        reader.start()
        assert reader.started.wait(60), srv.log_tail()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=10,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        reader.join(120)
        payloads = [p for _, p in reader.events]
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
        core.wait(timeout=30)
        assert not core.is_running()


def test_offline_llm_refuses_data_parallel():
    from pagedllm.config import EngineConfig
    from pagedllm.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="applies to the server"):
        LLMEngine(EngineConfig(data_parallel_size=2))
