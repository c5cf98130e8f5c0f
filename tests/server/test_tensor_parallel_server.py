"""`pagedllm serve -tp 3`: the engine core process runs rank 0 and starts two worker processes;
greedy output equals the tensor_parallel_size=1 server's, token for token; SIGTERM leaves no
process of the group behind."""

from __future__ import annotations

import signal

import httpx
import psutil
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPT = "The three primary colours are"


def _complete(srv) -> list[int]:
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
        "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def test_tp3_server_equals_tp1_and_exits_clean(server):
    reference = _complete(server)
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "-tp", "3", "--kv-cache-space",
                  "0.25", "--max-model-len", "1024"]) as srv:
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        workers = [p for p in family if "pagedllm.executor.worker_proc" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in family]
        assert _complete(srv) == reference
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, alive


def test_killed_server_leaves_no_core_or_worker_behind():
    """SIGKILL of the API server: the core notices its parent is gone (within a second) and
    exits, and its tensor-parallel workers with it."""
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "-tp", "3", "--kv-cache-space",
                  "0.25", "--max-model-len", "1024"]) as srv:
        family = psutil.Process(srv.proc.pid).children(recursive=True)
        assert any("pagedllm.executor.worker_proc" in " ".join(p.cmdline()) for p in family)
        srv.proc.kill()
        srv.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
