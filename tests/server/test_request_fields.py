"""vLLM's request fields on a real server, with the official `openai` client (issue 14):
each one honoured, or refused with a 400 naming it; unknown fields named in a header. One
server process for the whole module (docs/server_fields.md has the table)."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

GEN_CAP = 8  # the generation_config's max_new_tokens
MAX_LOGPROBS = 25
ALIAS = "smol-alias"


@pytest.fixture(scope="module")
def fields_server(tmp_path_factory):
    gen = tmp_path_factory.mktemp("genconfig")
    (gen / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": GEN_CAP}))
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.5",
                  "--max-model-len", str(MAX_MODEL_LEN), "--enable-prompt-tokens-details",
                  "--max-logprobs", str(MAX_LOGPROBS), "--generation-config", str(gen),
                  "--served-model-name", MODEL, ALIAS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(fields_server):
    return openai.OpenAI(base_url=f"{fields_server.url}/v1", api_key=fields_server.api_key,
                         max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def hx(fields_server):
    with httpx.Client(base_url=fields_server.url, headers=fields_server.headers,
                      timeout=120.0) as c:
        yield c


def _chat(**kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], **kw)


def _status(exc_info) -> int:
    return exc_info.value.status_code


# ---- refused, ignored ------------------------------------------------------------------------


def test_unimplemented_vllm_fields_are_400_by_name(oc):
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                              extra_body={"logits_processors": ["my.Processor"]})
    assert "logits_processors" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(**_chat(max_tokens=2),
                                   extra_body={"documents": [{"title": "t", "text": "x"}]})
    assert "documents" in str(e.value)
    # a no-op value of such a field is accepted
    oc.chat.completions.create(**_chat(max_tokens=1), extra_body={"modalities": ["text"]})


def test_unknown_fields_are_named_in_a_header(hx):
    r = hx.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                         "frobnicate": 3, "another_one": "x"})
    assert r.status_code == 200, r.text
    assert r.headers["x-pagedllm-ignored-fields"] == "another_one,frobnicate"
    r = hx.post("/v1/chat/completions", json=_chat(max_tokens=1, store=True))
    assert r.headers["x-pagedllm-ignored-fields"] == "store"
    r = hx.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert "x-pagedllm-ignored-fields" not in r.headers


# ---- ids, names, priority ------------------------------------------------------------------


def test_request_id_field_and_header(oc, hx):
    rid = f"mine-{uuid.uuid4().hex[:8]}"
    out = oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                extra_body={"request_id": rid})
    assert out.id == f"cmpl-{rid}"
    r = hx.post("/v1/chat/completions", json=_chat(max_tokens=1),
                headers={"X-Request-Id": rid})
    assert r.json()["id"] == f"chatcmpl-{rid}" and r.headers["x-request-id"] == rid


def test_every_served_model_name_is_accepted(oc):
    assert [m.id for m in oc.models.list().data] == [MODEL, ALIAS]
    out = oc.chat.completions.create(**{**_chat(max_tokens=1), "model": ALIAS})
    assert out.model == MODEL  # the first name is the reported one
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(**{**_chat(max_tokens=1), "model": "nope"})


def test_priority_under_fcfs_is_400(oc):
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"priority": 2})
    assert "priority" in str(e.value)
    oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"priority": 0})


# ---- token ids, truncation, logprobs ---------------------------------------------------------


def test_return_token_ids(oc, hx):
    prompt = "The capital of France is"
    ids = hx.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    out = oc.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                extra_body={"return_token_ids": True})
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids
    assert len(choice["token_ids"]) == out.usage.completion_tokens
    streamed, first_prompt_ids = [], None
    for chunk in oc.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                       extra_body={"return_token_ids": True}):
        c = chunk.choices[0].model_dump()
        first_prompt_ids = first_prompt_ids or c.get("prompt_token_ids")
        streamed += c.get("token_ids") or []
    assert first_prompt_ids == ids and streamed == choice["token_ids"]  # greedy default

    chat = oc.chat.completions.create(**_chat(max_tokens=3),
                                      extra_body={"return_token_ids": True}).model_dump()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    chunks = list(oc.chat.completions.create(**_chat(max_tokens=3), stream=True,
                                             extra_body={"return_token_ids": True}))
    got = [t for ch in chunks for c in ch.choices for t in (c.model_dump().get("token_ids") or [])]
    assert got == chat["choices"][0]["token_ids"]
    assert any(ch.model_dump().get("prompt_token_ids") for ch in chunks)


def test_truncate_prompt_tokens(oc, hx):
    long = "one two three four five six seven eight nine ten eleven twelve"
    kept = hx.post("/tokenize", json={"prompt": long}).json()["tokens"][-5:]
    kept_text = hx.post("/detokenize", json={"tokens": kept}).json()["prompt"]
    out = oc.completions.create(model=MODEL, prompt=long, max_tokens=1, echo=True,
                                extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    assert out.choices[0].text.startswith(kept_text) and "one two" not in out.choices[0].text
    chat = oc.chat.completions.create(**_chat(max_tokens=1),
                                      extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                              extra_body={"truncate_prompt_tokens": 0})


def test_prompt_logprobs_reach_the_engine(oc):
    out = oc.completions.create(model=MODEL, prompt="Paris is a city in", max_tokens=1,
                                extra_body={"prompt_logprobs": 2}).model_dump()
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == out["usage"]["prompt_tokens"] and plp[0] is None
    assert all(2 <= len(e) <= 3 for e in plp[1:])
    entry = next(iter(plp[1].values()))
    assert set(entry) == {"logprob", "rank", "decoded_token"}
    chat = oc.chat.completions.create(**_chat(max_tokens=1),
                                      extra_body={"prompt_logprobs": 1}).model_dump()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_max_logprobs_limits(oc):
    out = oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=MAX_LOGPROBS)
    assert len(out.choices[0].logprobs.top_logprobs[0]) >= 20
    for bad in (MAX_LOGPROBS + 1, -1):
        with pytest.raises(openai.BadRequestError) as e:
            oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=bad)
        assert "max-logprobs" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oc.chat.completions.create(**_chat(max_tokens=1), logprobs=True,
                                   top_logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                              extra_body={"prompt_logprobs": MAX_LOGPROBS + 1})


# ---- usage -----------------------------------------------------------------------------------


def test_continuous_usage_stats(oc):
    for create, kw in ((oc.completions.create, dict(model=MODEL, prompt="Count: 1, 2,")),
                       (oc.chat.completions.create, _chat())):
        chunks = list(create(**kw, max_tokens=5, stream=True,
                             stream_options={"include_usage": True,
                                             "continuous_usage_stats": True}))
        usages = [c.usage for c in chunks]
        assert all(u is not None for u in usages)
        done = [u.completion_tokens for u in usages]
        assert done == sorted(done) and done[-1] == usages[-1].total_tokens - usages[-1].prompt_tokens


def test_cached_tokens_in_usage(oc):
    prefix = f"{uuid.uuid4().hex} " + "a shared system prompt of many words " * 6
    first = oc.completions.create(model=MODEL, prompt=prefix + "first", max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = oc.completions.create(model=MODEL, prompt=prefix + "second", max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0
    msgs = [{"role": "system", "content": prefix}, {"role": "user", "content": "Hi"}]
    oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    chat = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 16
    last = list(oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, stream=True,
                                           stream_options={"include_usage": True}))[-1]
    assert last.usage.prompt_tokens_details.cached_tokens >= 16


# ---- chat echo, best_of, generation_config --------------------------------------------------


def test_chat_echo(oc):
    msgs = [{"role": "user", "content": "Finish the sentence."},
            {"role": "assistant", "content": "The sky is"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=3, add_generation_prompt=False)
    out = oc.chat.completions.create(**{k: v for k, v in kw.items() if k != "add_generation_prompt"},
                                     extra_body={"echo": True, "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert out.choices[0].message.content.startswith("The sky is")
    plain = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3,
                                       extra_body={"add_generation_prompt": False,
                                                   "continue_final_message": True})
    assert out.choices[0].message.content == "The sky is" + plain.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, stream=True,
        extra_body={"echo": True, "add_generation_prompt": False,
                    "continue_final_message": True}) if c.choices)
    assert text == out.choices[0].message.content


def test_best_of_returns_the_most_likely_samples(oc):
    kw = dict(model=MODEL, prompt="My favourite animal is the", max_tokens=6, temperature=1.0,
              seed=1234)
    all3 = oc.completions.create(**kw, n=3, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    best = oc.completions.create(**kw, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == all3.choices[scores.index(max(scores))].text
    two = oc.completions.create(**kw, n=2, best_of=3, logprobs=0)
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [c.text for c in two.choices] == [all3.choices[i].text for i in order]
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(**kw, n=3, best_of=2)
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(**kw, best_of=2, stream=True)
    assert "best_of" in str(e.value)


def test_generation_config_defaults_apply(oc):
    a = oc.chat.completions.create(**_chat())  # no temperature, no max_tokens
    b = oc.chat.completions.create(**_chat())
    assert a.usage.completion_tokens <= GEN_CAP
    assert a.choices[0].message.content == b.choices[0].message.content  # temperature 0
    capped = oc.chat.completions.create(**_chat(max_tokens=50, extra_body={"ignore_eos": True}))
    assert capped.usage.completion_tokens == GEN_CAP  # vLLM takes the smallest
    out = oc.completions.create(model=MODEL, prompt="Once upon a time",
                                extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == GEN_CAP  # min(16, max_new_tokens)


def test_chat_add_special_tokens_reaches_the_tokenizer():
    """vLLM's chat add_special_tokens (default false: the template has them) is what the
    tokenizer is called with (SmolLM2 adds no BOS, so the server cannot show a difference)."""
    from pagedllm.entrypoints.openai.chat import ChatServer
    from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest

    calls = []

    class Ctx:
        def render_chat(self, *a, **k):
            return "<rendered>"

        def encode(self, text, add_special_tokens=True):
            calls.append(add_special_tokens)
            return [1, 2, 3, 4]

        def decode(self, ids):
            return "x" * len(ids)

    server = ChatServer(Ctx())
    for flag in (False, True):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                    add_special_tokens=flag, truncate_prompt_tokens=2)
        text, ids = server._render(req, req.conversation())
        assert ids == [3, 4] and text == "xx"
    assert calls == [False, True]
