"""/v1/responses without a server: a Responses request's translation into chat's request,
the refusals by field name, and the stream events as the official client's types read them."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_output import StreamBuilder, response_object, usage
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.tool_calling import ParsedDelta

ADD = {"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": False}


def chat_of(**kw):
    req = ResponsesRequest(model="m", **kw)
    req.check()
    return req.to_chat([])


def test_items_become_chat_messages():
    chat = chat_of(instructions="Be brief.", tools=[ADD], max_output_tokens=5, top_k=3,
                   text={"format": {"type": "json_schema", "name": "x",
                                    "schema": {"type": "object"}, "strict": True}},
                   input=[{"role": "user", "content": [{"type": "input_text", "text": "1+2?"}]},
                          {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "Adding."}]},
                          {"type": "function_call", "call_id": "c1", "name": "add",
                           "arguments": '{"a": 1}'},
                          {"type": "function_call", "call_id": "c2", "name": "add",
                           "arguments": '{"a": 2}'},
                          {"type": "reasoning", "id": "rs_1", "summary": []},
                          {"type": "function_call_output", "call_id": "c2", "output": "3"}])
    conv = chat.conversation()
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "tool"]
    assert conv[2]["content"] == "Adding."
    assert [c["id"] for c in conv[2]["tool_calls"]] == ["c1", "c2"]
    assert conv[3] == {"role": "tool", "content": "3", "tool_call_id": "c2"}
    assert chat.tools[0].function.name == "add" and chat.tool_choice == "auto"
    assert chat.response_format.json_schema["schema"] == {"type": "object"}
    assert chat.max_completion_tokens == 5 and chat.top_k == 3


def test_input_image_parts_reach_chat_for_an_image_model():
    req = ResponsesRequest(model="m", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]}])
    (msg,) = req.to_chat([], takes_images=True).model_dump(exclude_none=True)["messages"]
    assert msg["content"] == [{"type": "text", "text": "What is it?"},
                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                  "detail": "low"}}]
    for bad, param in (({"type": "input_image", "file_id": "f"}, "input[0].content[0].file_id"),
                       ({"type": "input_image"}, "input[0].content[0].image_url")):
        with pytest.raises(OpenAIError) as info:
            ResponsesRequest(model="m", input=[{"role": "user", "content": [bad]}]).to_chat(
                [], takes_images=True)
        assert info.value.param == param
    with pytest.raises(OpenAIError) as info:  # an assistant's message holds no image
        ResponsesRequest(model="m", input=[{"role": "assistant", "content": [
            {"type": "input_image", "image_url": "x"}]}]).to_chat([], takes_images=True)
    assert info.value.param == "input[0].content[0].type"


def test_history_comes_first():
    req = ResponsesRequest(model="m", input="And then?")
    conv = req.to_chat([{"type": "message", "role": "user", "content": "Once"},
                        {"type": "message", "role": "assistant", "status": "completed",
                         "id": "msg_1", "content": [{"type": "output_text", "text": "upon",
                                                     "annotations": []}]}]).conversation()
    assert [(m["role"], m["content"]) for m in conv] == [
        ("user", "Once"), ("assistant", "upon"), ("user", "And then?")]


@pytest.mark.parametrize("param, kw", [
    ("truncation", dict(truncation="auto")),
    ("background", dict(background=True, store=False)),
    ("reasoning.effort", dict(reasoning={"effort": "extreme"})),
    ("reasoning.summary", dict(reasoning={"summary": "auto"})),
    ("include", dict(include=["file_search_call.results"])),
    ("tools[0].type", dict(tools=[{"type": "file_search"}])),
    ("tool_choice", dict(tools=[ADD], tool_choice={"type": "allowed_tools"})),
    ("text.verbosity", dict(text={"verbosity": "low"})),
    ("text.format.type", dict(text={"format": {"type": "grammar"}})),
    ("input[1].call_id", dict(input=[{"role": "user", "content": "x"},
                                     {"type": "function_call_output", "call_id": "x",
                                      "output": "1"}])),
    ("input[0].type", dict(input=[{"type": "item_reference", "id": "x"}])),
    ("input[0].role", dict(input=[{"type": "message", "role": "tool", "content": "x"}])),
    ("input[0].content[0].type", dict(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}])),
    ("metadata", dict(metadata={str(i): "v" for i in range(17)})),
    ("input", dict(input=[])),
])
def test_refused_by_name(param, kw):
    with pytest.raises(OpenAIError) as info:
        chat_of(**kw)
    assert info.value.param == param and info.value.status == 400


def test_strict_tools_reach_the_chat_plan():
    """Strict function tools are taken under any tool_choice: the chat plan enforces them."""
    chat = chat_of(input="x", tools=[{**ADD, "strict": True}])
    assert chat.tools[0].function.strict is True and chat.tool_choice == "auto"


def test_noop_values_are_accepted():
    chat_of(input="x", background=False, truncation="disabled", include=[], service_tier="auto")
    chat_of(input="x", background=True, reasoning={"effort": None, "summary": None})


def test_effort_reaches_the_template_as_reasoning_effort():
    chat = chat_of(input="x", reasoning={"effort": "low"},
                   chat_template_kwargs={"enable_thinking": True})
    assert chat.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    assert ResponsesRequest(model="m", input="x", foo=1).ignored_fields() == ["foo"]


def test_stream_events_validate_against_the_client_types():
    req = ResponsesRequest(model="m", input="x", tools=[ADD], tool_choice="required")
    b = StreamBuilder()
    raw = [b.emit("response.created", response=response_object(
        req, "resp_1", 1, "m", "in_progress", [], True))]
    raw += b.feed(ParsedDelta(reasoning_content="hm"))
    raw += b.feed(ParsedDelta(content="Hi"))
    raw += b.feed(ParsedDelta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": "add", "arguments": ""}}]))
    raw += b.feed(ParsedDelta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]))
    raw += b.finish("completed")
    raw.append(b.emit("response.completed", response=response_object(
        req, "resp_1", 1, "m", "completed", b.items, True, usage_=usage(10, 4, 8, 1))))
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(r.split("data: ", 1)[1])) for r in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][-5:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = Response.model_validate(events[-1].response.model_dump())
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Hi" and final.output[2].call_id == "call_1"
    assert final.usage.input_tokens_details.cached_tokens == 8
