"""Structured outputs through the official openai client against the real server:
response_format (json_schema, json_object), vLLM's structured_outputs (choice, regex) and
guided_* fields, allowed_token_ids / bad_words, streaming, n=3, and a bad schema (400, the
server keeps serving)."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a person (name and age) as JSON."}]
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_chat_response_format_json_schema_n3(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, n=3, temperature=0.9, seed=4,
        response_format=JSON_SCHEMA_FORMAT,
    )
    assert len(resp.choices) == 3
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_chat_response_format_json_object(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=100, temperature=0,
        response_format={"type": "json_object"},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_chat_response_format_streamed(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, stream=True,
        response_format=JSON_SCHEMA_FORMAT,
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_response_format(client):
    resp = client.completions.create(model=MODEL, prompt="A person as JSON: ", max_tokens=60,
                                     temperature=0, extra_body={"response_format": JSON_SCHEMA_FORMAT})
    jsonschema.validate(json.loads(resp.choices[0].text), PERSON)


def test_structured_outputs_choice(client):
    choices = ["red", "green", "blue"]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10,
        n=3, temperature=1.0, seed=1, extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.message.content in choices for c in resp.choices)


def test_structured_outputs_regex_streamed_completions(client):
    pattern = r"\d{3}-\d{4}"
    stream = client.completions.create(
        model=MODEL, prompt="Call me at ", max_tokens=20, temperature=0.7, seed=3, n=2,
        stream=True, extra_body={"structured_outputs": {"regex": pattern}},
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1]
    assert all(re.fullmatch(pattern, t) for t in texts.values()), texts


def test_guided_fields(client):
    resp = client.completions.create(model=MODEL, prompt="The answer is ", max_tokens=10,
                                     temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert resp.choices[0].text in ("yes", "no")
    resp = client.completions.create(model=MODEL, prompt="Year: ", max_tokens=10, temperature=0,
                                     extra_body={"guided_regex": r"(19|20)\d\d"})
    assert re.fullmatch(r"(19|20)\d\d", resp.choices[0].text)


def test_allowed_token_ids_and_bad_words(client, http):
    ids = http.post("/tokenize", json={"prompt": " yes no", "add_special_tokens": False}).json()
    allowed = ids["tokens"]
    resp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=5, temperature=1.0,
                                     seed=2, extra_body={"allowed_token_ids": allowed})
    text = resp.choices[0].text
    assert text and set(text.split()) <= {"yes", "no"}
    resp = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=8, temperature=0,
                                     extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in resp.choices[0].text


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
         "json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "grammar"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " ", "regex": "a"}}, "whitespace_pattern"),
        ({"response_format": JSON_SCHEMA_FORMAT, "guided_regex": "a"}, "Only one kind"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ],
)
def test_bad_constraints_are_400_and_server_goes_on(client, extra, match):
    import openai

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=match):
            resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                  stream=stream, extra_body=extra)
            if stream:
                list(resp)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          temperature=0)
    assert resp.choices[0].message.content
