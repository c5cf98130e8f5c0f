"""Tool calling and reasoning output through the official openai client against real servers:
the shared one (no tool flags: SmolLM2's template takes no tools, so every mode runs in the
generic mode, the reply constrained to an answer-or-calls envelope) and one started with
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, whose "auto"
path is driven with outputs pinned by structured output (`choice`), so the parsers run on real
model output through the real response path."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import serving
from tests.server.helpers import MAX_MODEL_LEN, MODEL
from tests.server.tool_templates import QWEN25_TOOL_TEMPLATE

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def create(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(**kw)


def check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])


def reassemble(stream):
    """The openai client's own reassembly of a streamed completion."""
    with stream as s:
        return s.get_final_completion()


# --------------------------------------------------------------- forced: any model calls


def test_required(client):
    out = create(client, tools=TOOLS, tool_choice="required")
    (c,) = out.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    check_calls(c.message.tool_calls)


def test_named(client):
    out = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    (c,) = out.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "add"
    check_calls([call])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble(client, choice):
    full = create(client, tools=TOOLS, tool_choice=choice).choices[0]
    streamed = reassemble(client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=60)).choices[0]
    assert streamed.finish_reason == "tool_calls"
    check_calls(streamed.message.tool_calls)
    assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls]


def test_stream_delta_shape(http):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
            "max_tokens": 40, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"]["tool_calls"] for e in events
              if e["choices"] and "tool_calls" in e["choices"][0]["delta"]]
    first = deltas[0][0]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["type"] == "function" and first["function"] == {"name": "add", "arguments": ""}
    rest = [d for ds in deltas[1:] for d in ds]
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                        for d in rest)
    json.loads("".join(d["function"]["arguments"] for d in rest))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_result_round_trip(trusted):
    """The call goes back in as an assistant message with tool_calls, the result as a tool
    message; the template receives both (checked on the rendered prompt) and the model
    answers. The request sends its own template: the trusted server."""
    client, http = trusted
    first = create(client, tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"},
    ]
    out = create(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12,
                 extra_body={"chat_template": QWEN25_TOOL_TEMPLATE})
    (c,) = out.choices
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    resp = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS,
                                        "chat_template": QWEN25_TOOL_TEMPLATE})
    assert resp.status_code == 200, resp.text
    assert resp.json()["count"] == out.usage.prompt_tokens
    prompt = http.post("/detokenize", json={"model": MODEL, "tokens": resp.json()["tokens"]}
                       ).json()["prompt"]
    args = json.dumps(json.loads(call.function.arguments))  # a dict through `tojson`
    assert f'{{"name": "get_weather", "arguments": {args}}}' in prompt
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in prompt
    assert '"name": "add"' in prompt  # the tools in the system prompt


def test_none_is_text(client):
    (c,) = create(client, tools=TOOLS, tool_choice="none", max_tokens=8).choices
    assert c.message.tool_calls is None and isinstance(c.message.content, str)


def test_refusals(client):
    with pytest.raises(openai.BadRequestError, match="`tools` must be set"):
        create(client, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="does not match"):
        create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        create(client, tools=TOOLS, tool_choice="required",
               response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="response_format"):  # generic "auto" constrains too
        create(client, tools=TOOLS, response_format={"type": "json_object"})
    assert create(client, max_tokens=2).choices[0].message.content is not None  # still up


# ------------------------------------------------ generic mode: "auto" with no flags, any model

@pytest.mark.parametrize("strict", [False, True])
def test_generic_auto_answers_or_calls(client, strict):
    """No flags, a template without tools: "auto" works (strict tools too: the envelope holds
    each tool's schema), streamed and not, and the two agree."""
    tools = [{"type": "function", "function": {**t["function"], "strict": strict}} for t in TOOLS]
    full = create(client, tools=tools, max_tokens=60).choices[0]
    if full.message.tool_calls:
        check_calls(full.message.tool_calls)
        assert full.finish_reason == "tool_calls" and full.message.content is None
        assert len(full.message.tool_calls) == 1  # parallel_tool_calls unset: one call in generic mode
    else:
        assert full.message.content and not full.message.content.lstrip().startswith("{")
    streamed = reassemble(client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, tools=tools, temperature=0, max_tokens=60)).choices[0]
    assert streamed.message.content == full.message.content
    assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls or []] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls or []]


def test_generic_answer_after_a_tool_result_round_trip(client):
    """Turn 2 of a tool loop: the assistant's call and the tool's result go back in (rewritten
    as envelopes for a template that cannot render them) and the request succeeds."""
    first = create(client, tools=TOOLS, tool_choice="required").choices[0]
    call = first.message.tool_calls[0]
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    out = create(client, messages=messages, tools=TOOLS, max_tokens=60).choices[0]
    assert out.finish_reason in ("stop", "tool_calls")
    if out.message.tool_calls:
        check_calls(out.message.tool_calls)
    else:
        assert out.message.content


def test_a_forced_call_spends_no_tokens_on_whitespace(client):
    """add(a=2, b=3) forced: the canonical separators only (12 tokens and the end of turn)."""
    out = create(client, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[ADD],
                 tool_choice="required")
    (call,) = out.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.function.arguments == '{"a": 2, "b": 3}'
    assert out.usage.completion_tokens <= 15


def test_a_cut_reply_returns_its_complete_calls(client):
    """parallel_tool_calls true and a budget that ends inside the second call: the first is a
    call, the cut one is dropped, finish_reason says length, nothing comes back as text."""
    kw = dict(tools=[ADD], tool_choice="required", parallel_tool_calls=True, max_tokens=45,
              messages=[{"role": "user", "content": "Add 2 and 3."}])
    c = create(client, **kw).choices[0]
    assert c.finish_reason == "length" and not c.message.content
    assert c.message.tool_calls and json.loads(c.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    # streamed (the client's helper refuses a cut reply, so the deltas are joined here): the
    # complete call streams whole, no content
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in create(client, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                calls.setdefault(tc.index, ["", ""])
                calls[tc.index][0] += tc.function.name or ""
                calls[tc.index][1] += tc.function.arguments or ""
    assert finish == "length" and not content
    assert calls[0] == ["add", c.message.tool_calls[0].function.arguments]


def test_hostile_tools_get_400_naming_the_field(http):
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    for tools, param in (
            ([{"type": "function", "function": {"name": "x" * 100_000}}], "tools[0].function.name"),
            ([{"type": "function", "function": {"name": f"t{i}"}} for i in range(1000)], "tools"),
            ([{"type": "function", "function": {"name": "big", "parameters": big}}],
             "tools[0].function.parameters")):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": tools})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    recursive = {"type": "object", "properties": {"node": {"$ref": "#/$defs/n"}},
                 "$defs": {"n": {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}}}}}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 30,
                                                "tools": [{"type": "function", "function": {
                                                    "name": "tree", "parameters": recursive}}]})
    assert r.status_code == 200, r.text[:300]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# ------------------------------------------------ "auto" with a tool parser, reasoning

FORCED_CALL = ('Adding them.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
               '</tool_call>')
FORCED_REASONING = "<think>One plus two.</think>\nThe sum is 3."


@pytest.fixture(scope="module")
def auto_client():
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25",
                  "--max-model-len", str(MAX_MODEL_LEN), "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0,
                            timeout=120.0)


def pinned(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def test_auto_parses_hermes_output(auto_client):
    kw = dict(tools=TOOLS, max_tokens=200, extra_body=pinned(FORCED_CALL))
    (c,) = create(auto_client, **kw).choices
    assert c.finish_reason == "tool_calls" and c.message.content == "Adding them."
    (call,) = c.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    s = reassemble(auto_client.chat.completions.stream(model=MODEL, messages=MESSAGES,
                                                       temperature=0, **kw)).choices[0]
    assert s.finish_reason == "tool_calls" and s.message.content == "Adding them."
    assert [(t.function.name, t.function.arguments) for t in s.message.tool_calls] == [
        ("add", call.function.arguments)]


def test_auto_free_output_is_valid_either_way(auto_client):
    (c,) = create(auto_client, tools=TOOLS, max_tokens=40).choices
    if c.message.tool_calls:
        check_calls(c.message.tool_calls)
        assert c.finish_reason == "tool_calls"
    else:
        assert isinstance(c.message.content, str) and c.finish_reason in ("stop", "length")


def test_strict_tools_under_auto_are_constrained(auto_client):
    """hermes "auto" with strict tools: free text until `<tool_call>`, then the call held to its
    tool's schema (a structural tag); sampled turns either answer or make calls that validate."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    for seed in range(6):
        (c,) = create(auto_client, tools=strict, temperature=1.0, seed=seed, max_tokens=80,
                      messages=[{"role": "user", "content": "Use a tool: weather in Paris or 2 + 3."}]).choices
        if c.message.tool_calls:
            check_calls(c.message.tool_calls)
    assert create(auto_client, max_tokens=4).choices[0].message.content is not None


def test_reasoning_content(auto_client):
    kw = dict(max_tokens=200, extra_body=pinned(FORCED_REASONING))
    (c,) = create(auto_client, **kw).choices
    assert c.message.model_extra["reasoning_content"] == "One plus two."
    assert c.message.content == "The sum is 3."
    chunks = list(create(auto_client, stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "One plus two."
    assert "".join(d.content or "" for d in deltas) == "The sum is 3."
    no = create(auto_client, max_tokens=200,
                extra_body={**pinned(FORCED_REASONING), "include_reasoning": False}).choices[0]
    assert no.message.model_extra.get("reasoning_content") is None
    assert no.message.content == "The sum is 3."
