"""The watchdog's SchedulerStallError, seen from a real server (tests/server/stall_server.py
stalls any request whose prompt carries STALL_MARKER): the stuck request gets a 500 (a JSON
error; in a stream, an error event), its blocks return to the pool, /health answers 503 with
the reason from then on, and other requests are still served."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.server.conftest import serving
from tests.server.helpers import API_KEY, MODEL, metric, wait_idle
from tests.server.stall_server import STALL_MARKER

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


@pytest.fixture(scope="module")
def stall_server():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with serving(["-m", "tests.server.stall_server", "--kv-cache-space", "0.25",
                  "--max-model-len", "1024"], cwd=root) as srv:
        yield srv


def test_stalled_request_fails_with_500_and_health_turns_503(stall_server):
    client = openai.OpenAI(base_url=f"{stall_server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=60.0)
    with httpx.Client(base_url=stall_server.url, headers=stall_server.headers,
                      timeout=60.0) as http:
        assert http.get("/health").status_code == 200
        ok = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})

        # non-streaming: a 500 with OpenAI's error body
        body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
        r = http.post("/v1/completions", json={**body, "prompt": f"{STALL_MARKER} one"})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "InternalServerError" and err["code"] == 500
        assert "no progress" in err["message"]
        m = wait_idle(http)
        assert metric(m, "pagedllm:kv_cache_used_blocks") == 0  # its blocks were returned
        assert metric(m, "vllm:num_requests_running") == 0

        health = http.get("/health")
        assert health.status_code == 503
        assert "unhealthy" in health.json()["error"]["message"]
        assert "no progress" in health.json()["error"]["message"]

        # streaming chat: the error arrives as an SSE event, then [DONE]
        with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 8, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{STALL_MARKER} two"}],
        }) as resp:
            assert resp.status_code == 200
            events = [line[len("data: "):] for line in resp.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "no progress" in error["message"]

        # the openai client sees an InternalServerError
        with pytest.raises(openai.InternalServerError):
            client.completions.create(prompt=f"{STALL_MARKER} three", **ok)

        # others are still served; health stays 503 until restart
        out = client.completions.create(prompt="Hello", **ok)
        assert out.choices[0].finish_reason == "length"
        assert http.get("/health").status_code == 503
        assert metric(wait_idle(http), "pagedllm:kv_cache_used_blocks") == 0


def test_importing_the_stall_server_patches_nothing_here():
    """Only the stall server's own processes stall: importing it for STALL_MARKER (above) must
    leave this process's EngineCore alone, or in-process engines of later tests stall."""
    from pagedllm.engine.core import EngineCore

    assert EngineCore.step.__qualname__ == "EngineCore.step"
