"""Multi-LoRA through a real `pagedllm serve` (engine core in its own process), with the
official openai client: adapters from --lora-modules (both forms) listed in /v1/models with
the base as parent and chosen by `model`, greedy output equal to peft's, streaming, runtime
load / unload behind the API key, bad adapters a 400 naming the problem, unknown names a 404,
vllm:lora_requests_info, and a plain request (and an empty pool) afterwards.
peft's outputs are stored references (tests/references.py; the live peft check is test_lora's)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.lora_fixtures import ADAPTERS, lora_reference, make_tiny_lora, tokenizer
from tests.server.conftest import serving
from tests.server.helpers import API_KEY, read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf):
    return make_tiny_lora(tmp_path_factory.mktemp("lora-server"), smollm2_gguf)


@pytest.fixture(scope="module")
def reference(tiny, smollm2_gguf):
    ids = tokenizer(smollm2_gguf).encode(PROMPT)
    out = {name: lora_reference(f"lora_server.{name or 'base'}", tiny, name, [ids], MAX_TOKENS)["greedy"][0]
           for name in [None, *ADAPTERS]}
    return ids, out


@pytest.fixture(scope="module")
def server(tiny):
    modules = [f"all7={tiny.adapters['all7']}",
               json.dumps({"name": "qv_rs", "path": str(tiny.adapters["qv_rs"]), "base_model_name": "tiny"})]
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", str(tiny.base), "--served-model-name", "tiny",
                  "--enable-lora", "--lora-modules", *modules, "--max-loras", "2", "--max-lora-rank", "16",
                  "--allow-runtime-lora-updating", "--kv-cache-space", "0.05", "--max-model-len", "512"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60.0) as c:
        yield c


def _tokens(client, model: str, ids: list[int]) -> list[int]:
    r = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model
    return r.choices[0].token_ids


def test_models_lists_adapters_with_the_base_as_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert {"tiny", "all7", "qv_rs"} <= set(cards)
    assert cards["all7"].parent == "tiny" and cards["qv_rs"].parent == "tiny"
    assert cards["tiny"].parent is None


def test_adapters_chosen_by_model_equal_peft_and_stream(client, reference):
    ids, want = reference
    for model, name in (("tiny", None), ("all7", "all7"), ("qv_rs", "qv_rs")):
        assert _tokens(client, model, ids) == want[name], model
    whole = client.completions.create(model="all7", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="all7", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
    assert text == whole.choices[0].text
    chat = client.chat.completions.create(model="qv_rs", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4)
    assert chat.model == "qv_rs" and chat.choices[0].finish_reason in ("length", "stop")


def test_unknown_model_is_a_404(client):
    import openai

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)


def test_runtime_load_and_unload_and_bad_adapters(http, client, tiny, reference, tmp_path):
    ids, want = reference
    ok = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp16", "lora_path": str(tiny.adapters["mlp16"])})
    assert ok.status_code == 200, ok.text
    assert _tokens(client, "mlp16", ids) == want["mlp16"]
    assert "mlp16" in {m.id for m in client.models.list().data}
    big = tmp_path / "big"
    shutil.copytree(tiny.adapters["all7"], big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(cfg | {"r": 32}))
    head = tmp_path / "head"
    shutil.copytree(tiny.adapters["all7"], head)
    (head / "adapter_config.json").write_text(json.dumps(cfg | {"target_modules": ["q_proj", "lm_head"]}))
    empty = tmp_path / "empty"
    empty.mkdir()
    for body, words in (
        ({"lora_name": "big", "lora_path": str(big)}, "32"),
        ({"lora_name": "head", "lora_path": str(head)}, "lm_head"),
        ({"lora_name": "empty", "lora_path": str(empty)}, "adapter_config.json"),
        ({"lora_name": "nowhere", "lora_path": str(tmp_path / "nowhere")}, "not a local directory"),
        ({"lora_name": "all7", "lora_path": str(tiny.adapters["all7"])}, "already been loaded"),
    ):
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], r.text
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp16"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp16"}).status_code == 404
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp16", prompt="x", max_tokens=2)
    unauthorized = http.post("/v1/load_lora_adapter", headers={"Authorization": "Bearer wrong"},
                             json={"lora_name": "x", "lora_path": str(tiny.adapters["mlp16"])})
    assert unauthorized.status_code == 401


def test_hostile_load_bodies_are_4xx_and_health_stays_true(http, client, tiny):
    """Wrong types, a 100k-character name, a path into the model's own folder (no adapter
    config), a huge lora_int_id to unload: each a 4xx naming the problem; /health then 200 and
    a plain request runs."""
    cases = [
        {"lora_name": 5, "lora_path": str(tiny.adapters["all7"])},
        {"lora_name": "x"},
        {"lora_name": "x" * 100_000, "lora_path": str(tiny.base)},
        {"lora_name": "base-dir", "lora_path": str(tiny.base)},
        {"lora_name": "dots", "lora_path": str(tiny.adapters["all7"]) + "/../../nope"},
    ]
    for body in cases:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (str(body)[:80], r.status_code, r.text[:200])
    r = http.post("/v1/unload_lora_adapter", json={"lora_int_id": 2**62})
    assert r.status_code == 404
    assert http.get("/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_lora_requests_info_and_a_plain_request_after(http, client, reference):
    ids, want = reference
    m = read_metrics(http)
    info = [labels for (name, labels), _ in m.items() if name == "vllm:lora_requests_info"]
    assert info and dict(info[0])["max_lora"] == "2"
    assert _tokens(client, "tiny", ids) == want[None]
    # the pool drains: every block back
    import time

    for _ in range(100):
        m = read_metrics(http)
        used = [v for (n, labels), v in m.items() if n == "pagedllm:kv_cache_used_blocks"]
        if used and used[0] == 0:
            break
        time.sleep(0.1)
    assert used[0] == 0
