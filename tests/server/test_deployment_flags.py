"""vLLM's deployment flags on one real server (issue 14): HTTPS (--ssl-keyfile/--ssl-certfile,
a self-signed certificate made by openssl), several --api-key, CORS (--allowed-origins ...),
--root-path, --enable-log-requests with --max-log-len, --disable-uvicorn-access-log,
--max-logprobs -1, and --scheduling-policy priority with --max-num-seqs 1 (requests sent
together finish in priority order). Unknown flags stop start-up naming them."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import STARTUP_TIMEOUT_S, Server
from tests.server.helpers import API_KEY, MODEL, free_port

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SECOND_KEY = "second-key-456"
ORIGIN = "http://allowed.example"
ROOT = "/gateway"
LOG_LEN = 12


def _self_signed(folder: str) -> tuple[str, str]:
    key, cert = os.path.join(folder, "key.pem"), os.path.join(folder, "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


@contextlib.contextmanager
def https_server(args: list[str]) -> Iterator[Server]:
    """conftest.serving, over HTTPS (its health poll speaks plain HTTP)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="pagedllm-https-", suffix=".log", delete=False)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("PAGEDLLM_API_KEY", None)
    proc = subprocess.Popen([sys.executable, *args, "--host", "127.0.0.1", "--port", str(port),
                             "--api-key", API_KEY], stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server("127.0.0.1", port, API_KEY, proc, log.name)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{srv.log_tail()}")
            try:
                if httpx.get(f"https://127.0.0.1:{port}/health", verify=False,
                             timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy:\n{srv.log_tail()}")
            time.sleep(0.5)
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


@pytest.fixture(scope="module")
def flags_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed for the self-signed certificate")
    key, cert = _self_signed(str(tmp_path_factory.mktemp("tls")))
    with https_server(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.5",
                       "--max-model-len", "1024", "--ssl-keyfile", key, "--ssl-certfile", cert,
                       "--api-key", SECOND_KEY, "--allowed-origins", f'["{ORIGIN}"]',
                       "--allowed-methods", '["GET", "POST"]', "--allow-credentials",
                       "--root-path", ROOT, "--enable-log-requests", "--max-log-len",
                       str(LOG_LEN), "--disable-uvicorn-access-log", "--uvicorn-log-level",
                       "info", "--max-logprobs", "-1", "--scheduling-policy", "priority",
                       "--max-num-seqs", "1"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def base(flags_server) -> str:
    return f"https://127.0.0.1:{flags_server.port}"


def _client(base: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120.0,
                         http_client=httpx.Client(verify=False))


def test_https_and_every_api_key(base):
    for key in (API_KEY, SECOND_KEY):
        out = _client(base, key).completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert out.usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        _client(base, "wrong").models.list()
    try:  # plain HTTP to the TLS port is not served
        plain = httpx.get(base.replace("https", "http") + "/health", timeout=5.0).status_code
    except httpx.HTTPError:
        plain = None
    assert plain != 200


def test_cors(base):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{base}/v1/completions", headers=pre, verify=False)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    r = httpx.options(f"{base}/v1/completions", verify=False,
                      headers={**pre, "Origin": "http://elsewhere.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{base}/v1/models", verify=False,
                  headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_root_path(base):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in (f"{ROOT}/v1/models", "/v1/models"):
        r = httpx.get(base + path, headers=auth, verify=False)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    spec = httpx.get(f"{base}/openapi.json", headers=auth, verify=False).json()
    assert spec.get("servers", [{}])[0].get("url") == ROOT


def test_logprobs_minus_one_is_the_whole_vocabulary(base):
    out = _client(base).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        logprobs=True, top_logprobs=-1)
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 49152


def test_priority_orders_requests_sent_together(base):
    client = _client(base)
    done: list[int] = []
    lock = threading.Lock()

    def run(priority: int, max_tokens: int) -> None:
        client.completions.create(model=MODEL, prompt=f"Story number {priority}:",
                                  max_tokens=max_tokens, temperature=0.0,
                                  extra_body={"ignore_eos": True, "priority": priority})
        with lock:
            done.append(priority)

    blocker = threading.Thread(target=run, args=(-1, 400))  # holds the only seat for seconds
    blocker.start()
    time.sleep(1.0)
    # 24 tokens each: one request's run (~24 steps) is much longer than the client threads'
    # jitter in seeing their responses (3 tokens each once let two appends cross).
    threads = [threading.Thread(target=run, args=(p, 24)) for p in (5, 2, 9, 0)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in [blocker, *threads]:
        t.join(120)
    assert done[0] == -1, "the blocker ended before the others were queued"
    assert done[1:] == [0, 2, 5, 9]


def test_request_log_and_no_access_log(flags_server, base):
    _client(base).completions.create(model=MODEL, prompt="0123456789abcdefghij", max_tokens=1)
    time.sleep(0.3)
    log = flags_server.log_tail(200_000)
    assert "Received request cmpl-" in log
    assert "'0123456789ab'" in log and "0123456789abc" not in log  # cut at --max-log-len
    assert "POST /v1/completions HTTP" not in log  # --disable-uvicorn-access-log


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size", "--no-such-flag"])
def test_unimplemented_flags_stop_start_up_naming_them(flag):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", flag, "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and flag in proc.stderr
