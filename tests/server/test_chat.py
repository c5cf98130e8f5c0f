"""POST /v1/chat/completions through the official openai client (and httpx for raw SSE)."""

from __future__ import annotations

import json

import pytest

from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

MESSAGES = [{"role": "user", "content": "Say hi"}]


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", MESSAGES)
    return client.chat.completions.create(**kw)


def chat_stream(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", MESSAGES)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    roles: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            if ch.delta.role is not None:
                assert ch.index not in texts, "the role comes first, once"
                roles[ch.index] = ch.delta.role
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    return texts, finish, roles, chunks


def test_chat_response_shape(client):
    out = chat(client, max_tokens=8, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi"},
    ])
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.model == MODEL and isinstance(out.created, int)
    (c,) = out.choices
    assert c.index == 0 and c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length") and c.logprobs is None
    assert "stop_reason" in c.model_extra
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert 0 < out.usage.completion_tokens <= 8


def test_content_parts_equal_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    a = chat(client, max_tokens=6, messages=parts)
    b = chat(client, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_multi_turn_with_assistant_message(client):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    out = chat(client, max_tokens=6, messages=messages)
    first = chat(client, max_tokens=6, messages=messages[:1])
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 4


@pytest.mark.parametrize("kw", [
    dict(max_tokens=12),
    dict(max_completion_tokens=10, stop=[" you", "!"]),
    dict(max_tokens=5, n=2, temperature=1.0, seed=3),
], ids=["greedy", "stop", "n2-seeded"])
def test_chat_stream_equals_non_stream(client, kw):
    full = chat(client, **kw)
    texts, finish, roles, _ = chat_stream(client, **kw)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert roles == {c.index: "assistant" for c in full.choices}


def test_max_completion_tokens_and_n_usage(client):
    out = chat(client, max_completion_tokens=4, n=3, temperature=0.9, seed=5,
               extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12
    # max_completion_tokens wins over the older max_tokens.
    out = chat(client, max_completion_tokens=3, max_tokens=9, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_stop_and_min_tokens(client):
    full = chat(client, max_tokens=12).choices[0].message.content
    word = full.split()[1]  # stop at the second word
    out = chat(client, max_tokens=12, stop=[word])
    c = out.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == word
    assert c.message.content == full[: full.index(word)]
    # A question the model answers in one word, then EOS: min_tokens keeps it going.
    q = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
    short = chat(client, messages=q, max_tokens=16)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 6
    longer = chat(client, messages=q, max_tokens=16, extra_body={"min_tokens": 8})
    assert longer.usage.completion_tokens >= 8


def test_chat_logprobs_shape(client):
    out = chat(client, max_tokens=5, logprobs=True, top_logprobs=3,
               extra_body={"ignore_eos": True})
    c = out.choices[0]
    content = c.logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == c.message.content
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token and values[0] == e.logprob  # greedy
    out = chat(client, max_tokens=3, logprobs=True)  # no top_logprobs: the token alone
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)


def test_chat_stream_logprobs_and_usage(http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    first, *deltas, last = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    tokens = [lp for c in deltas if c["choices"][0]["logprobs"]
              for lp in c["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 4 and all(len(t["top_logprobs"]) == 2 for t in tokens)
    assert all(c["usage"] is None for c in [first, *deltas])


def test_request_chat_template(trusted):
    """With --trust-request-chat-template (the shared server refuses them:
    tests/server/test_request_limits.py)."""
    client, http = trusted
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                "+ '<|im_end|>\\n' }}{% endfor %}{{ '<|im_start|>assistant\\n' }}")
    r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": template})
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    out = chat(client, max_tokens=3, extra_body={"chat_template": template})
    assert out.usage.prompt_tokens == r.json()["count"]  # no default system prompt
