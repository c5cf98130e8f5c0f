"""Input items in the Responses API's own typed shape, and the page of them that
`GET /v1/responses/{id}/input_items` lists.

A request's `input` may be loose (a string, `{"role", "content": "text"}` messages without ids);
what is stored, replayed by `previous_response_id` and listed is each item's canonical form with
an id: a message with `input_text` parts (`output_text` for the assistant), `function_call`,
`function_call_output` and `reasoning` items with their fields — what the client's
`ResponseItem` types parse. Canonicalization runs after translation (responses_protocol.py) has
refused what is not supported, so every item here has a known type.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_output import item_id, output_text

MAX_PAGE = 100
DEFAULT_PAGE = 20


def _message_parts(role: str, content: Any) -> list[dict[str, Any]]:
    assistant = role == "assistant"
    if content is None or isinstance(content, str):
        text = content or ""
        return [output_text(text) if assistant else {"type": "input_text", "text": text}]
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "refusal":
            parts.append({"type": "refusal", "refusal": str(part.get("refusal", ""))})
        elif kind == "input_image":
            parts.append({"type": "input_image", "image_url": part.get("image_url"),
                          "detail": part.get("detail") or "auto"})
        elif assistant:
            parts.append(output_text(str(part.get("text", ""))))
        else:
            parts.append({"type": "input_text", "text": str(part.get("text", ""))})
    return parts


def canonical_item(item: dict[str, Any]) -> dict[str, Any]:
    """One input item with an id and every field its type requires."""
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item["role"]
        return {"id": item.get("id") or item_id("msg"), "type": "message", "role": role,
                "content": _message_parts(role, item.get("content")),
                "status": item.get("status") or "completed"}
    if kind == "function_call":
        return {"id": item.get("id") or item_id("fc"), "type": "function_call",
                "call_id": item["call_id"], "name": item["name"],
                "arguments": item.get("arguments") or "{}",
                "status": item.get("status") or "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        return {"id": item.get("id") or item_id("fco"), "type": "function_call_output",
                "call_id": item["call_id"],
                "output": output if isinstance(output, (str, list)) else "",
                "status": item.get("status") or "completed"}
    if kind == "reasoning":
        return {"id": item.get("id") or item_id("rs"), "type": "reasoning",
                "summary": item.get("summary") or [], "content": item.get("content") or [],
                "status": item.get("status") or "completed"}
    raise ValueError(f"input item type {kind!r} reached canonicalization unchecked")


def canonical_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [canonical_item(item) for item in items]


def list_page(items: list[dict[str, Any]], after: str | None, limit: str | None,
              order: str | None) -> dict[str, Any]:
    """OpenAI's cursor page: `order` desc (the default: newest first) or asc, `limit` 1..100
    (default 20), `after` an item id of the previous page."""
    order = order or "desc"
    if order not in ("asc", "desc"):
        raise OpenAIError(f"`order` must be 'asc' or 'desc', got {order!r}.", 400, param="order")
    try:
        n = DEFAULT_PAGE if limit is None else int(limit)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_PAGE:
        raise OpenAIError(f"`limit` must be an integer from 1 to {MAX_PAGE}, got {limit!r}.",
                          400, param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise OpenAIError(f"`after`: no input item of this response has id {after!r}.",
                              400, param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + n]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + n < len(ordered)}
