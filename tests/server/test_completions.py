"""POST /v1/completions through the official openai client (and httpx for raw SSE)."""

from __future__ import annotations

import json
import time

import pytest

from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPT = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8, 9, ..."


def complete(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    return client.completions.create(**kw)


def stream(client, **kw):
    """(text per choice index, finish_reason per index, stop_reason per index, chunks)."""
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    stop_reasons: dict[int, object] = {}
    chunks = list(client.completions.create(stream=True, **kw))
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason is not None:
                assert ch.index not in finish, "a choice finished twice"
                finish[ch.index] = ch.finish_reason
                stop_reasons[ch.index] = ch.model_extra.get("stop_reason")
    return texts, finish, stop_reasons, chunks


def tokenize(http, text: str, **kw) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text, **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_response_shape_and_usage(client, http):
    t0 = int(time.time())
    out = complete(client, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == MODEL and t0 - 1 <= out.created <= time.time() + 1
    (choice,) = out.choices
    assert choice.index == 0 and choice.text.startswith(" 5, 6")
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert choice.model_extra["stop_reason"] is None
    n_prompt = len(tokenize(http, PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (n_prompt, 7, n_prompt + 7)


def test_prompt_forms_give_the_same_greedy_text(client, http):
    prompts = ["The capital of France is", PROMPT]
    ids = [tokenize(http, p) for p in prompts]
    single = [complete(client, prompt=p, max_tokens=6).choices[0].text for p in prompts]
    assert complete(client, prompt=ids[0], max_tokens=6).choices[0].text == single[0]
    for batch in (prompts, ids):
        out = complete(client, prompt=batch, max_tokens=6)
        assert [c.index for c in out.choices] == [0, 1]
        assert [c.text for c in out.choices] == single
        assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize("kw", [
    dict(max_tokens=12),
    dict(max_tokens=16, stop=[" 7", "\n\n"]),  # text held back while it may become " 7"
    dict(max_tokens=6, n=2, temperature=1.0, seed=7),
    dict(max_tokens=4, echo=True),
], ids=["greedy", "stop", "n2-seeded", "echo"])
def test_stream_equals_non_stream(client, kw):
    full = complete(client, prompt=PROMPT, **kw)
    texts, finish, stop_reasons, _ = stream(client, prompt=PROMPT, **kw)
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert stop_reasons == {c.index: c.model_extra["stop_reason"] for c in full.choices}


def test_stream_sse_format_and_usage(http):
    body = {"model": MODEL, "prompt": [PROMPT, "Hello"], "max_tokens": 5, "n": 2,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 * 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 20
    for c in deltas:
        assert c["object"] == "text_completion" and c["model"] == MODEL
        assert c["usage"] is None and len(c["choices"]) == 1
        assert set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason",
                                        "stop_reason"}
    finished = sorted(c["choices"][0]["index"] for c in deltas if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3]


def test_stream_without_usage_has_no_usage_field(http):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        raw = r.read().decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert chunks and all("usage" not in c for c in chunks)


def test_n_samples_and_usage(client):
    out = complete(client, prompt=PROMPT, max_tokens=5, n=3, temperature=0.8, seed=1,
                   extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    again = complete(client, prompt=PROMPT, max_tokens=5, n=3, temperature=0.8, seed=1,
                     extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    out = complete(client, prompt=[PROMPT, "Hello"], max_tokens=4, n=2,
                   extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy samples agree
    assert out.usage.completion_tokens == 16


def test_stop_strings_and_stop_token_ids(client, http):
    out = complete(client, prompt=PROMPT, max_tokens=16, stop=" 7")
    c = out.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (" 5, 6,", "stop", " 7")
    out = complete(client, prompt=PROMPT, max_tokens=16, stop=[" 7"],
                   extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == " 5, 6, 7"
    (comma,) = tokenize(http, ",", add_special_tokens=False)
    out = complete(client, prompt=PROMPT, max_tokens=16, extra_body={"stop_token_ids": [comma]})
    c = out.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (" 5", "stop", comma)


def test_logprobs_legacy_shape(client):
    out = complete(client, prompt="The capital of France is", max_tokens=5, logprobs=3,
                   extra_body={"ignore_eos": True})
    c = out.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == 5 == out.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert top[token] == value == max(top.values())  # greedy: the top token


def test_echo(client, http):
    prompt = "The capital of France is"
    out = complete(client, prompt=prompt, max_tokens=3, echo=True)
    plain = complete(client, prompt=prompt, max_tokens=3)
    assert out.choices[0].text == prompt + plain.choices[0].text
    assert out.usage.completion_tokens == 3
    # echo + max_tokens=0 + logprobs: the prompt's own logprobs (lm-eval style scoring).
    n_prompt = len(tokenize(http, prompt))
    out = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = out.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert "".join(c.logprobs.tokens) == prompt and len(c.logprobs.tokens) == n_prompt
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 0)
    # echo + logprobs with generation: prompt positions, then the generated ones.
    out = complete(client, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    assert len(out.choices[0].logprobs.tokens) == n_prompt + 2


def test_sampling_extras_change_the_output(client, http):
    greedy = complete(client, prompt=PROMPT, max_tokens=10).choices[0].text
    # top_k=1 and min_p=1 keep only the most likely token: greedy at any temperature.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        out = complete(client, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body=extra)
        assert out.choices[0].text == greedy, extra
    rep = complete(client, prompt=PROMPT, max_tokens=10,
                   extra_body={"repetition_penalty": 2.0}).choices[0].text
    assert rep != greedy
    out = complete(client, prompt=PROMPT, max_tokens=10, presence_penalty=0.5,
                   frequency_penalty=0.5, top_p=0.9, user="tester")
    assert out.choices[0].finish_reason in ("stop", "length")
    # logit_bias +100 on one token: greedy picks it every time.
    (paris,) = tokenize(http, " Paris", add_special_tokens=False)
    out = complete(client, prompt=PROMPT, max_tokens=3, logit_bias={str(paris): 100})
    assert out.choices[0].text == " Paris Paris Paris"


def test_eos_knobs(client, http):
    (eos,) = tokenize(http, "<|im_end|>", add_special_tokens=False)
    force_eos = {str(eos): 100}
    out = complete(client, prompt=PROMPT, max_tokens=5, logit_bias=force_eos)
    c = out.choices[0]
    assert (c.text, c.finish_reason, out.usage.completion_tokens) == ("", "stop", 1)
    out = complete(client, prompt=PROMPT, max_tokens=5, logit_bias=force_eos,
                   extra_body={"min_tokens": 3})
    assert out.usage.completion_tokens >= 3  # EOS blocked for the first 3 tokens
    out = complete(client, prompt=PROMPT, max_tokens=3, logit_bias=force_eos,
                   extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert out.choices[0].text.count("<|im_end|>") == 3 and out.usage.completion_tokens == 3
    out = complete(client, prompt=PROMPT, max_tokens=3, logit_bias=force_eos,
                   extra_body={"ignore_eos": True})
    assert out.choices[0].text == "" and out.usage.completion_tokens == 3


def test_use_beam_search_is_accepted(client, http):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "n": 2,
            "use_beam_search": True, "length_penalty": 1.0, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    if r.status_code == 400 and "not supported" in r.json()["error"]["message"]:
        pytest.skip("the engine does not run beam search yet")
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] != choices[1]["text"]  # two distinct beams
    r = http.post("/v1/completions", json={**body, "length_penalty": "long"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
