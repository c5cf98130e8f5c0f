"""/v1/responses through the official openai client against real servers: the shared one (text,
messages, instructions, JSON schema, forced function calls, the store, streaming, refusals) and
one started with `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
and a tool-aware template (tool calls parsed from the model's text, reasoning items, a tool
round trip through previous_response_id, two API keys, a store of 3 entries), whose outputs are
pinned by structured output (`choice`) so the parsers run on real model output."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.server.conftest import serving
from tests.server.helpers import API_KEY, MAX_MODEL_LEN, MODEL, metric, wait_idle
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
    ("background", dict(background=True, store=False)),
    ("reasoning.summary", dict(reasoning={"summary": "auto"})),
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
    ("tools[0].name", dict(tools=[{**ADD, "name": "x" * 100_000}])),
    ("tools", dict(tools=[{**ADD, "name": f"t{i}"} for i in range(200)])),
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


# ------------------------------------------------------------------ background, items, leaving


def poll(client, rid: str, until=("completed", "incomplete", "failed", "cancelled"),
         timeout: float = 60.0) -> Response:
    deadline = time.monotonic() + timeout
    while True:
        resp = client.responses.retrieve(rid)
        if resp.status in until or time.monotonic() > deadline:
            return valid(resp)
        time.sleep(0.05)


def test_background_polled_to_the_same_text(client):
    queued = valid(create(client, input="Say hello.", background=True, max_output_tokens=12))
    assert queued.background is True and queued.status == "queued" and queued.output == []
    done = poll(client, queued.id)
    plain = create(client, input="Say hello.", max_output_tokens=12)
    assert done.status == plain.status and text_of(done) == text_of(plain)  # greedy
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.cancel(done.id).status == done.status  # finished: as it is
    with pytest.raises(openai.BadRequestError) as info:  # only background ones cancel
        client.responses.cancel(plain.id)
    assert info.value.body["param"] == "response_id"


def test_background_cancel_frees_the_engine(client, http):
    resp = create(client, input="Count to a thousand.", background=True, max_output_tokens=1500,
                  extra_body={"ignore_eos": True})
    running = poll(client, resp.id, until=("in_progress",))
    assert running.status == "in_progress"
    with pytest.raises(openai.BadRequestError, match="in progress"):
        create(client, input="And?", previous_response_id=resp.id)
    cancelled = valid(client.responses.cancel(resp.id))
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(resp.id).status == "cancelled"
    assert client.responses.cancel(resp.id).status == "cancelled"  # idempotent
    doomed = create(client, input="Count to a thousand.", background=True,
                    max_output_tokens=1500, extra_body={"ignore_eos": True})
    poll(client, doomed.id, until=("in_progress",))
    client.responses.delete(doomed.id)
    m = wait_idle(http)
    with pytest.raises(openai.NotFoundError):  # stopped, and not kept again by its end
        client.responses.retrieve(doomed.id)
    assert metric(m, "vllm:num_requests_running") == 0
    assert metric(m, "pagedllm:kv_cache_used_blocks") == 0
    assert create(client, input="Hi.", max_output_tokens=2).status in ("completed", "incomplete")


def test_background_stream_resumes_after_any_event(client):
    events = list(create(client, input="Say hello.", background=True, stream=True,
                         max_output_tokens=10))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and types[-1] == f"response.{events[-1].response.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    rid = events[0].response.id
    resumed = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[4:]]
    assert text_of(client.responses.retrieve(rid)) == text_of(events[-1].response)
    plain = create(client, input="Say hello.", max_output_tokens=10)
    with pytest.raises(openai.BadRequestError) as info:  # not background: nothing to stream
        list(client.responses.retrieve(plain.id, stream=True))
    assert info.value.body["param"] == "stream"


def test_input_items_are_listed_and_paged(client):
    first = create(client, input=[{"role": "user", "content": "What is 1 + 2?"},
                                  {"role": "assistant", "content": "Let me add."},
                                  {"type": "message", "role": "user",
                                   "content": [{"type": "input_text", "text": "Go on."}]}],
                   max_output_tokens=2)
    page = client.responses.input_items.list(first.id)
    assert [(i.type, i.role) for i in page.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]  # newest first
    assert page.data[0].content[0].text == "Go on." and page.data[2].content[0].text == "What is 1 + 2?"
    ids = [i.id for i in client.responses.input_items.list(first.id, order="asc", limit=1)]
    assert ids == [i.id for i in reversed(page.data)]  # the auto-pager follows `after`
    second = create(client, input="And 2 + 3?", previous_response_id=first.id,
                    max_output_tokens=2)
    (own,) = client.responses.input_items.list(second.id).data  # its own input only
    assert own.content[0].text == "And 2 + 3?"
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.input_items.list(first.id, **bad)
        assert info.value.body["param"] == next(iter(bad))
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_" + "0" * 48)


def test_disconnect_aborts_and_hostile_values_leave_the_server_up(client, http):
    body = {"model": MODEL, "input": "Count to a thousand.", "stream": True,
            "max_output_tokens": 1500, "ignore_eos": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and "output_text.delta" in line:
                break  # decoding: leave
    m = wait_idle(http)
    assert metric(m, "vllm:num_requests_running") == 0
    assert metric(m, "pagedllm:kv_cache_used_blocks") == 0
    hostile = [{"input": [{"type": "message", "role": "user", "content": [{"type": "x"}]}]},
               {"input": "x", "metadata": {"k" * 65: "v"}},
               {"input": "x", "previous_response_id": "resp_\u0000"},
               {"input": "x", "max_output_tokens": 0}, {"input": "x", "max_output_tokens": 10**12},
               {"input": [{"type": "function_call", "name": 5}]}, {"input": {"a": 1}},
               {"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}},
               {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 5}],
                "tool_choice": "required"},
               {"input": "x", "reasoning": {"effort": "high"}}]
    for extra in hostile:
        r = http.post("/v1/responses", json={"model": MODEL, **extra})
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (extra, r.text)
    for path in ("/v1/responses/resp_x?stream=true&starting_after=-5",
                 "/v1/responses/resp_x/input_items?limit=abc"):
        assert 400 <= http.get(path).status_code < 500
    assert http.get("/health").status_code == 200
    assert create(client, input="Hi.", max_output_tokens=2).status in ("completed", "incomplete")


# ------------------------------------------------------------------ tool-parser server

FORCED_CALL = ('Adding them.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
               '</tool_call>')
FORCED_REASONING = "<think>One plus two.</think>\nThe sum is 3."
OTHER_KEY = "other-key-456"
# as gpt-oss's template does: the effort is written into the prompt
EFFORT_LINE = "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "qwen25.jinja"
    template.write_text(EFFORT_LINE + QWEN25_TOOL_TEMPLATE)
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


def test_reasoning_effort_reaches_the_template(tool_server):
    c = _client(tool_server, API_KEY)
    plain = create(c, input="1 + 2?", max_output_tokens=2)
    high = create(c, input="1 + 2?", max_output_tokens=2, reasoning={"effort": "high"})
    # "Reasoning: high\n" is in the prompt: a few tokens more
    assert 3 <= high.usage.input_tokens - plain.usage.input_tokens <= 6
    assert high.reasoning.effort == "high"


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
