"""/v1/responses through the official openai client against real servers: the shared one (text,
messages, instructions, JSON schema, forced function calls, the store, streaming, refusals) and
one started with `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
and a tool-aware template (tool calls parsed from the model's text, reasoning items, a tool
round trip through previous_response_id, two API keys, a store of 3 entries), whose outputs are
pinned by structured output (`choice`) so the parsers run on real model output."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.server.conftest import serving
from tests.server.helpers import API_KEY, MAX_MODEL_LEN, MODEL
from tests.server.tool_templates import QWEN25_TOOL_TEMPLATE

pytestmark = pytest.mark.slow  # starts servers: not in the quick `not slow` tier

ADD = {"type": "function", "name": "add", "description": "Add two integers", "strict": False,
       "parameters": {"type": "object", "additionalProperties": False,
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
CITY = {"type": "object", "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer"}},
        "required": ["city", "population"]}
LONG_INPUT = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))


def create(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 16)
    return client.responses.create(**kw)


def valid(resp) -> Response:
    """The response as the client's own type validates it (not the lenient construct)."""
    return Response.model_validate(resp.model_dump(by_alias=True))


def text_of(resp) -> str:
    return "".join(p.text for item in resp.output if item.type == "message"
                   for p in item.content)


# ------------------------------------------------------------------ shared server


def test_text_input(client):
    resp = valid(create(client, input="Say hello."))
    assert resp.id.startswith("resp_") and len(resp.id) > 40 and resp.object == "response"
    assert resp.status in ("completed", "incomplete") and resp.model == MODEL
    (msg,) = resp.output
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].text
    u = resp.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 16
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens


def test_messages_and_instructions_match_chat(client):
    """The same conversation through both protocols: the same prompt, the same greedy text."""
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}]
    resp = create(client, input=inp, instructions="You answer in one word.",
                  metadata={"k": "v"}, user="u1")
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=16,
        messages=[{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "Name a fruit."}])
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert text_of(resp) == chat.choices[0].message.content
    assert resp.instructions == "You answer in one word." and resp.metadata == {"k": "v"}


def test_max_output_tokens_incomplete(client):
    resp = valid(create(client, input="Count to fifty.", max_output_tokens=3,
                        extra_body={"ignore_eos": True}))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"


def test_json_schema(client):
    resp = valid(create(client, input="A city and its population, as JSON.",
                        max_output_tokens=200,
                        text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                         "strict": True}}))
    assert resp.status == "completed", resp.usage
    jsonschema.validate(json.loads(text_of(resp)), CITY)
    assert resp.text.format.type == "json_schema"
    # json_object: the grammar holds from the first token (SmolLM2 greedy runs past 200 tokens
    # inside the object, so the text is a cut object, not parsed)
    obj = create(client, input="Any JSON object.", max_output_tokens=20,
                 text={"format": {"type": "json_object"}})
    assert text_of(obj).lstrip().startswith("{") and obj.text.format.type == "json_object"


def test_forced_call_round_trip_reuses_cache(client):
    """A named tool forced by the grammar; its output goes back through
    previous_response_id; the second turn's prompt starts with the first's (prefix cache)."""
    first = valid(create(client, input=LONG_INPUT + " Now add 2 and 3.", tools=[ADD],
                         tool_choice={"type": "function", "name": "add"}, max_output_tokens=30))
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    second = valid(create(client, previous_response_id=first.id, tools=[ADD], tool_choice="none",
                          input=[{"type": "function_call_output", "call_id": call.call_id,
                                  "output": "5"}]))
    assert second.previous_response_id == first.id and second.output[-1].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.9 * first.usage.input_tokens, (cached, first.usage.input_tokens)


def test_store_retrieve_delete(client):
    resp = create(client, input="Hi.", max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output[0].content[0].text == text_of(resp) and got.store
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = create(client, input="Hi.", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        create(client, input="Hi.", previous_response_id=unstored.id)


def _refused(client, param: str, **kw) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    assert info.value.body["param"] == param, info.value.body
    head = param.split("[")[0].split(".")[0]
    assert head in info.value.body["message"] or head.replace("_", " ") in info.value.body["message"]


@pytest.mark.parametrize("param, kw", [
    ("truncation", dict(truncation="auto")),
    ("background", dict(background=True)),
    ("include", dict(include=["reasoning.encrypted_content"])),
    ("prompt", dict(prompt={"id": "pmpt_1"})),
    ("tools[0].type", dict(tools=[{"type": "web_search"}])),
    ("reasoning.effort", dict(reasoning={"effort": "high"})),
    ("text.format.schema", dict(text={"format": {"type": "json_schema", "name": "x"}})),
    ("input[0].type", dict(input=[{"type": "computer_call_output", "call_id": "c",
                                   "output": {}}])),
    ("input[0].call_id", dict(input=[{"type": "function_call_output", "call_id": "nope",
                                      "output": "1"}])),
    ("input[0].content[0].type", dict(input=[{"role": "user", "content": [
        {"type": "input_file", "file_id": "f"}]}])),
    ("text.format.schema", dict(text={"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}})),  # the grammar refuses it
    ("tool_choice", dict(tools=[ADD])),  # "auto" needs the tool parser flags
    ("tools[0].strict", dict(tools=[{**ADD, "strict": True}])),
])
def test_refused_by_name(client, param, kw):
    kw.setdefault("input", "Hi.")
    _refused(client, param, **kw)


def test_unknown_previous_response_is_404_and_server_stays_up(client):
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="Hi.", previous_response_id="resp_" + "0" * 48)
    assert info.value.body["param"] == "previous_response_id"
    assert create(client, input="Hi.", max_output_tokens=2).status in ("completed", "incomplete")


def test_stream_text_events(client):
    events = list(create(client, input="Say hello.", stream=True, max_output_tokens=12))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{events[-1].response.status}"]
    assert all(type(e).__module__.startswith("openai.types") for e in events)
    final = valid(events[-1].response)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text_of(final) == events[-4].text
    assert final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output[0].content[0].text == deltas
    plain = create(client, input="Say hello.", max_output_tokens=12)
    assert text_of(plain) == deltas  # greedy: the same text streamed or not


def test_stream_helper_and_incomplete(client):
    """The client's own stream helper (it needs `response.completed`: the output is pinned so
    that it ends); a cut stream ends with `response.incomplete`."""
    with client.responses.stream(model=MODEL, input="Greet me.", temperature=0,
                                 max_output_tokens=20,
                                 extra_body={"structured_outputs": {"choice": ["Hello there."]}}
                                 ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[-1] == "response.completed" and final.output_text == "Hello there."
    events = list(create(client, input="Count to fifty.", stream=True, max_output_tokens=4,
                         extra_body={"ignore_eos": True}))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.usage.output_tokens == 4
    assert last.response.incomplete_details.reason == "max_output_tokens"


def test_stream_forced_tool_call(client):
    events = list(create(client, input="Add 2 and 3.", stream=True, tools=[ADD],
                         tool_choice={"type": "function", "name": "add"}, max_output_tokens=30))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == args
    jsonschema.validate(json.loads(args), ADD["parameters"])
    final = valid(events[-1].response)
    assert final.status == "completed" and final.output[-1].type == "function_call"
    assert final.output[-1].arguments == args


# ------------------------------------------------------------------ tool-parser server

FORCED_CALL = ('Adding them.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
               '</tool_call>')
FORCED_REASONING = "<think>One plus two.</think>\nThe sum is 3."
OTHER_KEY = "other-key-456"


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "qwen25.jinja"
    template.write_text(QWEN25_TOOL_TEMPLATE)
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "--kv-cache-space", "0.25",
                  "--max-model-len", str(MAX_MODEL_LEN), "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                  "--chat-template", str(template), "--api-key", OTHER_KEY,
                  "--responses-store-max-entries", "3"]) as srv:
        yield srv


def _client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120.0)


def pinned(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def test_auto_call_and_round_trip(tool_server):
    c = _client(tool_server, API_KEY)
    first = valid(create(c, input="What is 1 + 2?", tools=[ADD], max_output_tokens=200,
                         extra_body=pinned(FORCED_CALL)))
    msg, call = first.output
    assert msg.type == "message" and msg.content[0].text == "Adding them."
    assert call.type == "function_call" and call.name == "add"
    assert json.loads(call.arguments) == {"a": 1, "b": 2}
    second = valid(create(c, previous_response_id=first.id, tools=[ADD], max_output_tokens=200,
                          input=[{"type": "function_call_output", "call_id": call.call_id,
                                  "output": "3"}], extra_body=pinned("The sum is 3.")))
    assert text_of(second) == "The sum is 3."
    # the replayed call and its output are in the second prompt (Qwen2.5's tool tags)
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    events = list(create(c, input="What is 1 + 2?", tools=[ADD], max_output_tokens=200,
                         stream=True, extra_body=pinned(FORCED_CALL)))
    streamed = valid(events[-1].response)
    assert [(o.type, getattr(o, "name", None)) for o in streamed.output] == [
        ("message", None), ("function_call", "add")]
    assert streamed.output[1].arguments == call.arguments


def test_reasoning_items(tool_server):
    c = _client(tool_server, API_KEY)
    resp = valid(create(c, input="1 + 2?", max_output_tokens=200,
                        extra_body=pinned(FORCED_REASONING)))
    reasoning, msg = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "One plus two."
    assert msg.content[0].text == "The sum is 3."
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    events = list(create(c, input="1 + 2?", max_output_tokens=200, stream=True,
                         extra_body=pinned(FORCED_REASONING)))
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == "One plus two."
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_keys_see_only_their_own_and_store_bound(tool_server):
    mine, theirs = _client(tool_server, API_KEY), _client(tool_server, OTHER_KEY)
    resp = create(mine, input="Hi.", max_output_tokens=2)
    assert mine.responses.retrieve(resp.id).id == resp.id
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        create(theirs, input="Hi.", previous_response_id=resp.id)
    later = [create(mine, input="Hi.", max_output_tokens=2).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):  # the least recently used of 4 > 3 is gone
        mine.responses.retrieve(resp.id)
    assert [mine.responses.retrieve(i).id for i in later] == later
