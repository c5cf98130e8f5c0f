"""A decoder embedding model (tiny Qwen3Model: last-token pooling through the paged engine)
behind a real `pagedllm serve`, with the official openai client: /v1/embeddings (float,
base64, the client's default, token ids, dimensions, usage), /pooling, /score and /rerank by
cosine similarity, hostile bodies as 400s naming the field (nothing lost: a plain request
succeeds after them), and the refusals by name both ways (pooling model: generation
endpoints; generation model: pooling endpoints). The pooling server is the one engine's server:
its embedding requests count in the vLLM-named series of /metrics (success, prompt tokens,
end-to-end latency; nothing left running or holding a KV block), the dashboard's snapshot
answers, and hostile values are 4xx that leave the engine serving the next plain request."""

from __future__ import annotations

import base64
import concurrent.futures
import time

import numpy as np
import pytest
import torch

from tests.integration.pooling_fixtures import save_decoder_embedder
from tests.references import reference as stored_reference
from tests.server.conftest import serving
from tests.server.helpers import read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

NAME = "tiny-embed"
TEXTS = ["the capital of france is paris", "a cat and a dog", "what is the memory cache of the engine"]
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-served")
    save_decoder_embedder(path, "qwen3", seed=11)
    return path


@pytest.fixture(scope="module")
def embed_server(model_dir):
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", str(model_dir), "--served-model-name", NAME,
                  "--max-model-len", str(MAX_LEN), "--num-kv-blocks", "128", "--block-size", "8"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(embed_server):
    import httpx
    import openai

    with httpx.Client(base_url=embed_server.url, headers=embed_server.headers, timeout=60.0) as http:
        yield openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key=embed_server.api_key, max_retries=0,
                            timeout=60.0), http


@pytest.fixture(scope="module")
def reference(model_dir):
    """The tokenizer, and transformers' last hidden state of the last token, normalised, per text
    (stored: tests/references.py, `pooling_server.last_token`; the plain transformers pooling
    reference computed live is test_pooling_parity's architecture-default test)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def last_token():
        from transformers import AutoModel

        model = AutoModel.from_pretrained(model_dir).eval()
        with torch.no_grad():
            vecs = [model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS]
        return torch.nn.functional.normalize(torch.stack(vecs), dim=-1)

    # tolerance: float32 rounding on another CPU (~1e-7), well under the tests' 1e-4
    vecs = stored_reference("pooling_server.last_token", last_token, sources=[model_dir], inputs={"texts": TEXTS},
                            tolerance=1e-5)
    return tok, torch.tensor(vecs)


def test_embeddings_float_base64_and_default(clients, reference):
    client, _ = clients
    _, ref = reference
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    got = torch.tensor([d.embedding for d in sorted(floats.data, key=lambda d: d.index)])
    assert (got - ref).abs().max().item() <= 1e-4
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    raw = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")
    decoded = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype=np.float32)
                                     for d in raw.data]))
    # equal up to float rounding: the second request may be served from the prefix cache
    assert (decoded - got).abs().max().item() <= 1e-5
    default = client.embeddings.create(model=NAME, input=TEXTS[0])  # the client asks base64 and decodes
    assert (torch.tensor(default.data[0].embedding) - got[0]).abs().max().item() <= 1e-5


def test_token_ids_dimensions_and_single_string(clients, reference):
    client, _ = clients
    tok, ref = reference
    ids = tok(TEXTS[1])["input_ids"]
    one = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    many = client.embeddings.create(model=NAME, input=[ids, tok(TEXTS[2])["input_ids"]], encoding_format="float")
    assert (torch.tensor(one.data[0].embedding) - ref[1]).abs().max().item() <= 1e-4
    assert (torch.tensor(many.data[1].embedding) - ref[2]).abs().max().item() <= 1e-4
    small = client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=16, encoding_format="float")
    vec = torch.tensor(small.data[0].embedding)
    assert vec.shape == (16,) and abs(vec.norm().item() - 1) < 1e-5


def test_pooling_score_and_rerank_by_cosine(clients, reference):
    _, http = clients
    _, ref = reference
    r = http.post("/pooling", json={"model": NAME, "input": TEXTS})
    assert r.status_code == 200, r.text
    assert (torch.tensor(r.json()["data"][2]["data"]) - ref[2]).abs().max().item() <= 1e-4
    r = http.post("/v1/score", json={"model": NAME, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert r.status_code == 200, r.text
    cos = [float(ref[0] @ ref[i]) for i in (1, 2)]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(cos, abs=1e-4)
    r = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1})
    assert r.status_code == 200, r.text
    (best,) = r.json()["results"]
    assert best["index"] == int(np.argmax(cos))
    assert best["relevance_score"] == pytest.approx(max(cos), abs=1e-4)
    assert best["document"]["text"] == TEXTS[1 + int(np.argmax(cos))]


HOSTILE = [
    ({"input": []}, "input"),
    ({"input": "paris " * 200}, "input"),  # too long, no truncation asked
    ({"input": ["a"] * 10_000}, "input"),
    ({"input": 123}, "input"),
    ({"input": [1.5, 2.5]}, "input"),
    ({"input": [[1, 2], "mixed"]}, "input"),
    ({"input": [10**9]}, "input"),  # out of vocabulary
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": "16"}, "dimensions"),
    ({"input": "x", "dimensions": 4096}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ({"input": "x", "priority": 3}, "priority"),  # a field pagedllm does not implement
    ({"input": "x", "shiny_new_field": True}, "shiny_new_field"),
    ({"input": "x", "model": "no-such-model"}, "model"),
]


@pytest.mark.parametrize("body,field", HOSTILE, ids=[f for _, f in HOSTILE])
def test_bad_embedding_requests_are_400s_naming_the_field(clients, body, field):
    _, http = clients
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == field or field in err["message"], err
    ok = http.post("/v1/embeddings", json={"input": "a plain request"})
    assert ok.status_code == 200, ok.text


def test_truncation_and_concurrency(clients):
    _, http = clients
    r = http.post("/v1/embeddings", json={"input": "paris " * 200, "truncate_prompt_tokens": 32})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 32, r.text
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(lambda i: http.post("/v1/embeddings", json={"input": f"{TEXTS[i % 3]} {i}"}).status_code,
                              range(64)))
    assert codes == [200] * 64


def test_pooling_model_refuses_generation_endpoints(clients):
    _, http = clients
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = http.post(path, json={"model": NAME, "prompt": "hi", "messages": []})
        assert r.status_code == 400 and path in r.json()["error"]["message"], r.text
    r = http.post("/classify", json={"input": "hi"})
    assert r.status_code == 400 and "classify" in r.json()["error"]["message"], r.text
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == NAME


def test_generation_model_refuses_pooling_endpoints(http):
    """The suite's shared SmolLM2 server (tests/server/conftest.py)."""
    for path in ("/v1/embeddings", "/rerank", "/v1/score", "/classify", "/pooling"):
        r = http.post(path, json={"input": "hi"})
        assert r.status_code == 400, r.text
        assert path in r.json()["error"]["message"] and "generation model" in r.json()["error"]["message"]


def _value(values: dict, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted({"model_name": NAME, "engine": "0", **labels}.items()))), 0.0)


def _idle_metrics(http, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(http)
        if (_value(m, "vllm:num_requests_running") == 0 and _value(m, "pagedllm:kv_cache_used_blocks") == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_embeddings_count_in_metrics_and_dashboard_answers(clients):
    client, http = clients
    before = _idle_metrics(http)
    out = client.embeddings.create(model=NAME, input=["the cat", "a dog and a tree"], encoding_format="float")
    assert len(out.data) == 2 and out.usage.prompt_tokens > 0
    after = _idle_metrics(http)
    assert _value(after, "vllm:request_success_total", finished_reason="stop") \
        - _value(before, "vllm:request_success_total", finished_reason="stop") == 2
    assert _value(after, "vllm:prompt_tokens_total") - _value(before, "vllm:prompt_tokens_total") \
        == out.usage.prompt_tokens
    assert _value(after, "vllm:e2e_request_latency_seconds_count") \
        - _value(before, "vllm:e2e_request_latency_seconds_count") == 2
    assert _value(after, "vllm:num_requests_running") == 0  # the series exists and the requests left
    assert _value(after, "pagedllm:kv_cache_used_blocks") == 0  # their blocks went back
    snap = http.get("/v1/internal/engine_state")
    assert snap.status_code == 200, snap.text
    state = snap.json()
    assert "engines" in state or "num_blocks" in str(state), state
    assert http.get("/dashboard").status_code == 200


@pytest.mark.parametrize("body, status", [
    ({"input": "the cat", "dimensions": 0}, 400),
    ({"input": "the cat", "dimensions": -3}, 400),
    ({"input": "the cat", "dimensions": 10**9}, 400),
    ({"input": "the cat", "dimensions": "wide"}, 400),
    ({"input": [[]]}, 400),
    ({"input": []}, 400),
    ({"input": "paris " * 50_000}, 400),
    ({"input": ["ok", "paris " * 200]}, 400),
    ({"input": [[1, 10**9]]}, 400),
])
def test_hostile_values_are_4xx_and_a_plain_request_succeeds_after(clients, body, status):
    client, http = clients
    r = http.post("/v1/embeddings", json={"model": NAME, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"], r.text
    ok = client.embeddings.create(model=NAME, input="a plain request", encoding_format="float")
    assert len(ok.data[0].embedding) == 64
    m = _idle_metrics(http)
    assert _value(m, "pagedllm:kv_cache_used_blocks") == 0
