"""A cross-encoder (tiny BertForSequenceClassification, one label) behind a real `pagedllm
serve`: /rerank, /v1/rerank and /v2/rerank in Jina's and Cohere's request shapes with
relevance scores equal to sentence-transformers' `CrossEncoder.predict` (order included),
/score and /v1/score, /classify; /v1/embeddings refused by task; hostile bodies are 400s
naming the field, and a plain request succeeds after them. `CrossEncoder.predict`'s scores are
stored (tests/references.py, `rerank_server.cross_encoder`; the live CrossEncoder check is
test_pooling_parity's ce-bert)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.integration.pooling_fixtures import save_encoder
from tests.references import reference
from tests.server.conftest import serving

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

NAME = "tiny-reranker"
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat is on the tree", "a small blue book", "music of the city"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rerank-served")
    save_encoder(path, classifier_labels=1, seed=21)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", str(model_dir), "--served-model-name", NAME]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def expected(model_dir):
    if importlib.util.find_spec("sentence_transformers") is None:  # installed; imported only to compute
        pytest.skip("could not import 'sentence_transformers'")

    def predict():
        from sentence_transformers import CrossEncoder

        return [float(s) for s in CrossEncoder(str(model_dir), device="cpu").predict([(QUERY, d) for d in DOCS])]

    # tolerance: float32 rounding on another CPU (~1e-7), well under the tests' 1e-4
    return reference("rerank_server.cross_encoder", predict, sources=[model_dir],
                     inputs={"query": QUERY, "documents": DOCS}, libs=("transformers", "sentence-transformers"),
                     tolerance=1e-5)


def test_jina_shape_rerank(http, expected):
    r = http.post("/v1/rerank", json={"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 3,
                                      "return_documents": True})
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-4)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert body["usage"]["total_tokens"] > 0 and body["model"] == NAME


def test_cohere_shape_rerank(http, expected):
    for path in ("/v2/rerank", "/rerank"):
        r = http.post(path, json={"model": NAME, "query": QUERY, "documents": [{"text": d} for d in DOCS],
                                  "return_documents": False})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == len(DOCS) and all("document" not in x for x in results)
        assert [x["relevance_score"] for x in results] == pytest.approx(sorted(expected, reverse=True), abs=1e-4)


def test_score_and_classify(http, expected):
    for path in ("/score", "/v1/score"):
        r = http.post(path, json={"model": NAME, "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(expected, abs=1e-4)
    r = http.post("/classify", json={"model": NAME, "input": DOCS[:2]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["num_classes"] for d in data] == [1, 1] and all(0 < d["probs"][0] < 1 for d in data)


HOSTILE = [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ({"query": 7, "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": "not a list"}, "documents"),
    ({"query": QUERY, "documents": [{"txt": "x"}]}, "documents"),
    ({"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 10}, "max_tokens_per_doc"),  # Cohere's, not implemented
    ({"query": QUERY, "documents": DOCS, "rank_fields": ["text"]}, "rank_fields"),
    ({"query": QUERY * 100, "documents": DOCS}, "documents"),  # too long without truncation
]


@pytest.mark.parametrize("body,field", HOSTILE, ids=[f"{i}-{f}" for i, (_, f) in enumerate(HOSTILE)])
def test_bad_rerank_requests_are_400s_naming_the_field(http, body, field):
    r = http.post("/rerank", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or field in err["message"], err
    ok = http.post("/rerank", json={"query": QUERY, "documents": DOCS[:2]})
    assert ok.status_code == 200, ok.text


def test_cross_encoder_refuses_embeddings_and_generation(http):
    r = http.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "embed" in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"], r.text


def test_core_process_death_is_503_then_exit_1(server, http):
    """Last in this module: the pooling engine runs in its own process; killed, /health and
    requests answer 503 naming why, and the server exits 1 for a supervisor to restart."""
    import psutil

    cores = [c for c in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(cores) == 1, cores
    cores[0].kill()
    r = None
    for _ in range(100):
        try:
            r = http.get("/health")
        except Exception:
            break
        if r.status_code == 503:
            break
        time.sleep(0.05)
    assert r is None or r.status_code == 503
    assert server.proc.wait(timeout=30) == 1
