"""Input items as GET /v1/responses/{id}/input_items lists them: each in the client's own
`ResponseItem` type, with an id, and paged as OpenAI pages (newest first by default)."""

from __future__ import annotations

import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_items import canonical_items, list_page

LOOSE = [
    {"role": "user", "content": "What is 1 + 2?"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Adding."}]},
    {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
    {"type": "function_call_output", "call_id": "c1", "output": "3"},
    {"type": "reasoning", "id": "rs_given", "summary": []},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
]


def test_canonical_items_parse_as_the_client_types():
    items = canonical_items(LOOSE)
    adapter = TypeAdapter(ResponseItem)
    parsed = [adapter.validate_python(item) for item in items]
    assert [type(p).__name__ for p in parsed] == [
        "ResponseInputMessageItem", "ResponseOutputMessage", "ResponseFunctionToolCallItem",
        "ResponseFunctionToolCallOutputItem", "ResponseReasoningItem",
        "ResponseInputMessageItem"]
    assert parsed[0].content[0].text == "What is 1 + 2?" and parsed[1].content[0].text == "Adding."
    assert items[4]["id"] == "rs_given"  # a given id is kept
    assert len({item["id"] for item in items}) == len(items)


def test_pages_newest_first_with_a_cursor():
    items = [{"id": f"msg_{i}"} for i in range(5)]
    first = list_page(items, None, "2", None)
    assert [d["id"] for d in first["data"]] == ["msg_4", "msg_3"] and first["has_more"]
    second = list_page(items, first["last_id"], "2", None)
    assert [d["id"] for d in second["data"]] == ["msg_2", "msg_1"] and second["has_more"]
    third = list_page(items, second["last_id"], "2", None)
    assert [d["id"] for d in third["data"]] == ["msg_0"] and not third["has_more"]
    asc = list_page(items, None, None, "asc")
    assert [d["id"] for d in asc["data"]] == [f"msg_{i}" for i in range(5)]
    assert (asc["first_id"], asc["last_id"], asc["has_more"]) == ("msg_0", "msg_4", False)


@pytest.mark.parametrize("after, limit, order, param", [
    (None, "0", None, "limit"), (None, "101", None, "limit"), (None, "x", None, "limit"),
    (None, None, "sideways", "order"), ("msg_nope", None, None, "after")])
def test_bad_page_arguments_are_named(after, limit, order, param):
    with pytest.raises(OpenAIError) as info:
        list_page([{"id": "msg_1"}], after, limit, order)
    assert info.value.status == 400 and info.value.param == param
