"""Speculative decoding through a real `pagedllm serve` (engine core in its own process):
greedy completions equal the plain offline engine's, streamed deltas add up to the same text,
vLLM's spec-decode counters move, a bad --speculative-config stops the start-up with its
reason, and plain requests still run afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import serving
from tests.server.helpers import MODEL, read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PROMPTS = ["The cat sat on the mat. The dog sat on the log. The cat sat on the",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,"]


@pytest.fixture(scope="module")
def spec_http():
    import httpx

    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25", "--max-model-len", "1024",
                  "--speculative-config", SPEC]) as srv:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120.0) as c:
            yield c


def _counter(m: dict, name: str) -> float:
    return sum(v for (n, labels), v in m.items() if n == name and dict(labels).get("model_name") == MODEL)


def test_greedy_equals_plain_and_counters_move(spec_http, smollm2_llm):
    from pagedllm import SamplingParams

    want = [o.outputs[0].text for o in smollm2_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)]
    got = []
    for p in PROMPTS:
        r = spec_http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == want
    m = read_metrics(spec_http)
    assert _counter(m, "vllm:spec_decode_num_drafts_total") > 0
    assert 0 < _counter(m, "vllm:spec_decode_num_accepted_tokens_total") <= _counter(
        m, "vllm:spec_decode_num_draft_tokens_total")


def test_streamed_deltas_add_up_and_hostile_values_then_plain(spec_http):
    import json

    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0}
    whole = spec_http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    text = ""
    with spec_http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == whole
    for bad in ({"max_tokens": 10**9}, {"min_tokens": 10**6, "max_tokens": 4}, {"n": 10**6}):
        assert spec_http.post("/v1/completions", json=body | bad).status_code == 400
    ok = spec_http.post("/v1/completions", json=body | {"max_tokens": 8, "stop": ["5"]})
    assert ok.status_code == 200 and "5" not in ok.json()["choices"][0]["text"]


@pytest.mark.parametrize("config, words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not supported"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "'eagle3' is not supported"),
])
def test_a_bad_speculative_config_stops_the_start_up_with_its_reason(config, words):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0",
                           "--speculative-config", config], capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert words in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]


SUFFIX = '{"method": "suffix", "num_speculative_tokens": 8}'


def test_suffix_decoding_served_equals_plain_and_reuses_earlier_outputs(smollm2_llm):
    """vLLM's suffix method through a real server: greedy output equals the plain engine's, a
    repeated request is drafted from the global tree of earlier outputs (more accepted tokens
    the second time), a hostile request is a 400 and a plain request still runs."""
    import httpx

    from pagedllm import SamplingParams

    want = [o.outputs[0].text for o in smollm2_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)]
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25", "--max-model-len", "1024",
                  "--speculative-config", SUFFIX]) as srv:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120.0) as c:
            accepted = []
            for _ in range(2):
                got = []
                for p in PROMPTS:
                    r = c.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 40,
                                                        "temperature": 0})
                    assert r.status_code == 200, r.text
                    got.append(r.json()["choices"][0]["text"])
                assert got == want
                accepted.append(_counter(read_metrics(c), "vllm:spec_decode_num_accepted_tokens_total"))
            assert 0 < accepted[0] < accepted[1] - accepted[0], accepted
            bad = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10**9})
            assert bad.status_code == 400
            ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
