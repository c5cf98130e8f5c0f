"""Faults injected into a real `pagedllm serve` (the engine core in its own process): each ends
either with only the faulty request failed (and a plain request served, /health 200), or with
the server answering 503 and exiting non-zero within 5 s; never a hang, never /health 200 with
a dead engine.

The faults are patched into the core process by tests/server/fault_hooks/sitecustomize.py
(PYTHONPATH + PAGEDLLM_TEST_FAULT); a request whose prompt ends with FAULT_MARK triggers it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server.conftest import serving
from tests.server.fault_hooks.sitecustomize import FAULT_MARK, inject_worker_fault
from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow

SERVE = ["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.1",
         "--max-model-len", "512", "--max-num-seqs", "8"]
HOOKS = str(Path(__file__).parent / "fault_hooks")
MARKED = {"model": MODEL, "prompt": [1, 2, 3, FAULT_MARK], "max_tokens": 4, "temperature": 0}
PLAIN = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def _post(srv, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, json=body,
                      timeout=timeout)


def _health(srv) -> int:
    return httpx.get(f"{srv.url}/health", timeout=5).status_code


@pytest.fixture
def fault(monkeypatch, tiny_llama_folder):
    """`fault(kind, args)`: a server with that fault armed; by default on a tiny random Llama
    (the faults are in the engine's machinery, not in SmolLM2), served under SmolLM2's name."""
    tiny = [*SERVE, "--model", tiny_llama_folder, "--served-model-name", MODEL]

    def start(kind: str, args: list[str] | None = None):
        args = tiny if args is None else args
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            [HOOKS, str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setenv("PAGEDLLM_TEST_FAULT", kind)
        return serving(args)

    return start


@pytest.mark.parametrize("kind, status, says", [
    ("input_message", 400, "could not read this request"),
    ("output_message", 500, "could not send this request's output"),
])
def test_a_message_that_fails_fails_only_its_request(fault, kind, status, says):
    with fault(kind) as srv:
        r = _post(srv, MARKED)
        assert r.status_code == status, r.text
        assert says in r.json()["error"]["message"]
        assert _post(srv, PLAIN, timeout=10).status_code == 200
        assert _health(srv) == 200
        assert srv.proc.poll() is None


@pytest.mark.parametrize("kind", ["input_thread", "output_thread", "forward"])
def test_a_fault_outside_one_request_is_fatal_503_and_exit_nonzero(fault, kind):
    with fault(kind) as srv:
        t0 = time.monotonic()
        try:
            r = _post(srv, MARKED, timeout=10)
            assert r.status_code == 503, r.text
        except httpx.TransportError:
            pass  # the server may be gone before it answers: never a hang
        saw_503 = False
        while srv.proc.poll() is None and time.monotonic() - t0 < 5.0:
            try:
                saw_503 |= _health(srv) == 503
            except httpx.TransportError:
                break
            time.sleep(0.05)
        try:
            code = srv.proc.wait(timeout=max(0.1, 5.0 - (time.monotonic() - t0)))
        except Exception:
            raise AssertionError(f"still running {time.monotonic() - t0:.1f} s after the fault:"
                                 f"\n{srv.log_tail()}") from None
        assert code != 0, srv.log_tail()
        assert saw_503 or time.monotonic() - t0 < 1.5  # 503 while it lingered (1 s)


def test_sigkill_of_a_tensor_parallel_worker_mid_step_is_fatal(fault):
    """The zombie core: a dead worker used to make every later step fail with a 500 while
    /health said 200. Now the step's failure is fatal: 503 and exit within 5 s."""
    import threading

    args = [*SERVE, "-tp", "3"]  # SmolLM2: 9 heads, 3 KV heads
    with fault("none", args) as srv:
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        worker, *_ = [p for p in family
                     if "pagedllm.executor.worker_proc" in " ".join(p.cmdline())]
        result: dict = {}

        def stream() -> None:
            try:
                result["r"] = _post(srv, {**PLAIN, "max_tokens": 400, "ignore_eos": True},
                                    timeout=60)
            except httpx.TransportError as exc:
                result["r"] = exc

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        time.sleep(1.0)  # mid-generation
        worker.kill()
        t0 = time.monotonic()
        code = srv.proc.wait(timeout=5.0)
        assert code != 0, srv.log_tail()
        assert time.monotonic() - t0 < 5.0
        reader.join(10)
        r = result["r"]
        assert isinstance(r, httpx.TransportError) or r.status_code == 503, r
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.cmdline() for p in alive]


def test_an_exception_in_a_tensor_parallel_workers_forward_is_fatal(monkeypatch):
    """Rank 1 raises in its first step (tests/server/fault_hooks): the request gets a 503
    naming the worker's error, and the server exits non-zero within 5 s."""
    inject_worker_fault(monkeypatch, "1:step")
    with serving([*SERVE, "-tp", "3"]) as srv:
        t0 = time.monotonic()
        r = _post(srv, PLAIN, timeout=30)
        assert r.status_code == 503, r.text
        assert "fault injected" in r.json()["error"]["message"], srv.log_tail()
        code = srv.proc.wait(timeout=5.0)
        assert code != 0 and time.monotonic() - t0 < 5.0 + 2.0, srv.log_tail()
