"""A draft model through a real `pagedllm serve` (engine core in its own process): SmolLM2 as
its own draft; greedy completions and a chat turn equal the plain offline engine's, a stream's
deltas add up, nearly every draft is accepted, hostile values are 400s with the pool back to
empty, a constrained request (which a draft model does not speculate for) and a plain request
run after; a draft of another vocabulary stops the start-up with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.model_source import default_model_path
from tests.server.conftest import serving
from tests.server.helpers import MODEL, read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPTS = ["The cat sat on the mat. The dog sat on the log. The cat sat on the",
           "Write the numbers from one to ten in words:"]


@pytest.fixture(scope="module")
def draft_http():
    import httpx

    spec = json.dumps({"model": str(default_model_path()), "num_speculative_tokens": 3})
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25", "--max-model-len", "1024",
                  "--speculative-config", spec]) as srv:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120.0) as c:
            yield c


def _counter(m: dict, name: str) -> float:
    return sum(v for (n, labels), v in m.items() if n == name and dict(labels).get("model_name") == MODEL)


def test_greedy_equals_plain_and_nearly_all_drafts_are_accepted(draft_http, smollm2_llm):
    from pagedllm import SamplingParams

    plain = smollm2_llm
    want = [o.outputs[0].text for o in plain.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32),
                                                      use_tqdm=False)]
    got = [draft_http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 32,
                                                    "temperature": 0}).json()["choices"][0]["text"] for p in PROMPTS]
    assert got == want
    chat = [{"role": "user", "content": "Say hello in French."}]
    want_chat = plain.chat(chat, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    r = draft_http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat, "max_tokens": 16,
                                                       "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want_chat
    m = read_metrics(draft_http)
    drafted = _counter(m, "vllm:spec_decode_num_draft_tokens_total")
    assert drafted > 0 and _counter(m, "vllm:spec_decode_num_accepted_tokens_total") >= 0.9 * drafted


def test_stream_hostile_values_constrained_then_plain(draft_http):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    whole = draft_http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    text = ""
    with draft_http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == whole
    for bad in ({"max_tokens": 10**9}, {"min_tokens": 10**6, "max_tokens": 4}, {"n": 10**6},
                {"best_of": 10**9}, {"prompt": "x " * 5000}):
        r = draft_http.post("/v1/completions", json=body | bad)
        assert r.status_code == 400, (bad, r.text)
    r = draft_http.post("/v1/completions", json=body | {"structured_outputs": {"regex": "[0-9]{3}"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].isdigit()
    ok = draft_http.post("/v1/completions", json=body | {"max_tokens": 8})
    assert ok.status_code == 200 and whole.startswith(ok.json()["choices"][0]["text"])
    m = read_metrics(draft_http)
    used = sum(v for (n, _), v in m.items() if n == "pagedllm:kv_cache_used_blocks")
    assert used == 0


def test_a_draft_of_another_vocabulary_stops_the_start_up(tmp_path):
    from tests.integration.model_fixtures import make_hf_model, save_checkpoint, tiny_config

    save_checkpoint(make_hf_model(tiny_config("llama")), tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0",
                           "--speculative-config", json.dumps({"model": str(tmp_path), "num_speculative_tokens": 2})],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert "vocabulary of 256 tokens, the target 49152" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
