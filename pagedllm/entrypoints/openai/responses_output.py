"""The Responses API's output shapes: the `response` object, its `output` items (`reasoning`,
`message` with `output_text`, `function_call`), its usage, and the typed stream events with
their `sequence_number` (OpenAI's shapes, as the official client's types define them).

A streamed response is built item by item (`StreamBuilder`) from the chat parser's deltas; the
final `response.completed` / `response.incomplete` event carries the same items.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.tool_calling import ParsedDelta, ParsedOutput


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def function_call_item(call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(parsed: ParsedOutput, status: str) -> list[dict[str, Any]]:
    """A finished output's items: reasoning, then the message (if any text, or nothing else),
    then one function_call per tool call."""
    items = []
    if parsed.reasoning_content:
        items.append(reasoning_item(parsed.reasoning_content))
    if parsed.content or not parsed.tool_calls:
        items.append(message_item(parsed.content or "", status))
    for tc in parsed.tool_calls:
        items.append(function_call_item(tc.id, tc.function.name, tc.function.arguments))
    return items


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int | None,
          reasoning_tokens: int = 0) -> dict[str, Any]:
    """`cached_tokens`: prompt tokens the prefix cache served (always reported here);
    `cache_write_tokens`: the rest of the prompt, computed and cached by this request."""
    cached = cached_tokens or 0
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached,
                                     "cache_write_tokens": max(prompt_tokens - cached, 0)},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details): a cut at max tokens (or the context) is incomplete."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(request: ResponsesRequest, response_id: str, created_at: int, model: str,
                    status: str, output: list[dict[str, Any]], stored: bool,
                    usage_: dict[str, Any] | None = None,
                    incomplete: dict[str, str] | None = None,
                    error: dict[str, str] | None = None) -> dict[str, Any]:
    fmt = (request.text or {}).get("format") or {"type": "text"}
    body = {
        "id": response_id, "object": "response", "created_at": created_at, "model": model,
        "status": status, "output": output, "error": error, "incomplete_details": incomplete,
        "instructions": request.instructions, "metadata": request.metadata or {},
        "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "temperature": request.temperature, "top_p": request.top_p,
        "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
        "tools": request.tools or [], "text": {"format": fmt}, "truncation": "disabled",
        "reasoning": request.reasoning, "store": stored, "user": request.user,
        "background": bool(request.background), "usage": usage_,
    }
    if status in ("completed", "incomplete"):
        body["completed_at"] = int(time.time())
    return body


def event(kind: str, seq: int, **fields: Any) -> str:
    """One server-sent event: `event: <type>` and its JSON (no [DONE]: OpenAI sends none)."""
    data = {"type": kind, "sequence_number": seq, **fields}
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


class StreamBuilder:
    """The output items of a stream as the parser's deltas arrive, and their events. An item
    stays open (its deltas go out) until an item of another kind starts or the output ends."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the tool call index -> its item

    def emit(self, kind: str, **fields: Any) -> str:
        text = event(kind, self.seq, **fields)
        self.seq += 1
        return text

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.items.append(item)
        self._open = item
        idx = len(self.items) - 1
        out.append(self.emit("response.output_item.added", output_index=idx, item=dict(item)))
        if item["type"] == "message":
            item["content"] = [output_text("")]
            out.append(self.emit("response.content_part.added", item_id=item["id"],
                                 output_index=idx, content_index=0, part=output_text("")))
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": ""}]
            out.append(self.emit("response.content_part.added", item_id=item["id"],
                                 output_index=idx, content_index=0,
                                 part={"type": "reasoning_text", "text": ""}))
        return out

    def feed(self, delta: ParsedDelta) -> list[str]:
        out: list[str] = []
        if delta.reasoning_content:
            if self._open is None or self._open["type"] != "reasoning":
                out += self._start({"id": item_id("rs"), "type": "reasoning", "summary": [],
                                    "content": [], "status": "in_progress"})
            item = self._open
            item["content"][0]["text"] += delta.reasoning_content
            out.append(self.emit("response.reasoning_text.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0,
                                 delta=delta.reasoning_content))
        if delta.content:
            if self._open is None or self._open["type"] != "message":
                out += self._start({"id": item_id("msg"), "type": "message",
                                    "role": "assistant", "status": "in_progress",
                                    "content": []})
            item = self._open
            item["content"][0]["text"] += delta.content
            out.append(self.emit("response.output_text.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0,
                                 delta=delta.content, logprobs=[]))
        for tc in delta.tool_calls:
            fn = tc.get("function") or {}
            item = self._calls.get(tc["index"])
            if item is None:
                item = function_call_item(tc.get("id") or item_id("call"), fn.get("name", ""),
                                          "", status="in_progress")
                self._calls[tc["index"]] = item
                out += self._start(item)
            args = fn.get("arguments") or ""
            if args:
                item["arguments"] += args
                out.append(self.emit("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=self.items.index(item),
                                     delta=args))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """The open item's closing events (`status`: incomplete when the output was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        idx = self.items.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.emit("response.output_text.done", item_id=item["id"],
                                 output_index=idx, content_index=0, text=part["text"],
                                 logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item["id"],
                                 output_index=idx, content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.emit("response.reasoning_text.done", item_id=item["id"],
                                 output_index=idx, content_index=0, text=part["text"]))
            out.append(self.emit("response.content_part.done", item_id=item["id"],
                                 output_index=idx, content_index=0, part=dict(part)))
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=idx, arguments=item["arguments"]))
        item["status"] = status if item["type"] == "message" else "completed"
        out.append(self.emit("response.output_item.done", output_index=idx, item=item))
        return out

    def finish(self, status: str) -> list[str]:
        """Close the last item; an output with no item at all gets an empty message."""
        if not self.items:
            out = self._start({"id": item_id("msg"), "type": "message", "role": "assistant",
                               "status": "in_progress", "content": []})
            return out + self.close(status)
        return self.close(status)
