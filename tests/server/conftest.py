"""One real server for the whole tests/server suite: `pagedllm serve` (no model: the default
SmolLM2-135M-Instruct) in a subprocess on a free loopback port, with an API key, a small KV
cache and max_model_len 2048. Start-up (model and tokenizer load) takes 10-20 s, so every
module reuses it; tests that look at counters use differences, and run one after another."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests import startups
from tests.server.helpers import API_KEY, MAX_MODEL_LEN, free_port

STARTUP_TIMEOUT_S = 240


@dataclass
class Server:
    host: str
    port: int
    api_key: str
    proc: subprocess.Popen
    log_path: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def _wait_healthy(server: Server) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


@contextlib.contextmanager
def serving(args: list[str], cwd: str | None = None) -> Iterator[Server]:
    """A server process (`python <args>` plus host, port and API key) on a free loopback port;
    yields once /health is 200, terminates it (then kills it) on the way out."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="pagedllm-server-", suffix=".log", delete=False)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("PAGEDLLM_API_KEY", None)
    cmd = [sys.executable, *args, "--host", "127.0.0.1", "--port", str(port),
           "--api-key", API_KEY, "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    startups.record("servers started (pagedllm serve processes)")
    srv = Server("127.0.0.1", port, API_KEY, proc, log.name)
    try:
        _wait_healthy(srv)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="session")
def server():
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.5",
                  "--max-model-len", str(MAX_MODEL_LEN)]) as srv:
        yield srv


@pytest.fixture(scope="session")
def trusted_server():
    """A server that takes chat templates sent in requests (--trust-request-chat-template);
    the shared one refuses them, as vLLM does by default."""
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25",
                  "--max-model-len", str(MAX_MODEL_LEN), "--trust-request-chat-template"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def trusted(trusted_server):
    """(openai client, httpx client) of the trusted server."""
    import httpx
    import openai

    with httpx.Client(base_url=trusted_server.url, headers=trusted_server.headers,
                      timeout=120.0) as http:
        yield openai.OpenAI(base_url=f"{trusted_server.url}/v1",
                            api_key=trusted_server.api_key, max_retries=0, timeout=120.0), http


@pytest.fixture(scope="session")
def client(server):
    """The official openai client (no retries: each status must be seen as it is)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0,
                         timeout=120.0)


@pytest.fixture(scope="session")
def http(server):
    """httpx, for what the openai client hides (raw SSE, error bodies, non-/v1 routes)."""
    import httpx

    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120.0) as c:
        yield c
