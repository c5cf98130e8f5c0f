"""The shape most tool-call formats share: content, then a marker the model writes to open its
calls, then the calls as JSON (one object or an array of `{"name", "arguments"}`). Granite 3.x
(`<|tool_call|>`), Phi-4-mini and FireFunction (`functools`) and Mistral's first format
(`[TOOL_CALLS]`) are this shape with their own marker."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    Split,
    ToolParser,
    partial_prefix_len,
    strict_json_object,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import scan_calls, value_end

_WS = " \t\r\n"


def content_until(text: str, marker: str, finished: bool) -> tuple[str, int]:
    """(the content before `marker`, the index just past it; -1 when it is not there). While
    streaming, a tail that may be the marker's start is held back."""
    j = text.find(marker)
    if j >= 0:
        return text[:j], j + len(marker)
    held = 0 if finished else partial_prefix_len(text, marker)
    return text[:len(text) - held], -1


def json_calls(text: str, start: int, finished: bool) -> Split:
    """The calls in text[start:]: one JSON object or an array of them, nothing after it."""
    body = text[start:].lstrip(_WS)
    if not body:
        return Split([], [], ok=not finished)
    if body[0] not in "[{":
        return Split([], [], ok=False)
    i = len(text) - len(body)
    end, closed = value_end(text, i)
    calls, ok = scan_calls(text[:end], i)
    if finished:
        whole = text[i:end]
        ok = ok and closed and not text[end:].strip(_WS) and bool(calls)
        ok = ok and all(c.done and strict_json_object(text[c.start:c.end]) is not None for c in calls)
        ok = ok and (whole.startswith("[") or len(calls) == 1)
    return Split([], calls, ok)


class MarkerJsonToolParser(ToolParser):
    """Content, `marker`, then the calls as JSON. Subclasses set `name` and `marker`."""

    marker = ""

    def split(self, text: str, finished: bool) -> Split:
        content, start = content_until(text, self.marker, finished)
        if start < 0:
            return Split([content], [])
        found = json_calls(text, start, finished)
        return Split([content], found.calls, found.ok)


class GraniteToolParser(MarkerJsonToolParser):
    """IBM Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}]`."""

    name = "granite"
    marker = "<|tool_call|>"


class Phi4MiniToolParser(MarkerJsonToolParser):
    """Phi-4-mini and FireFunction v2: `functools[{"name": ..., "arguments": {...}}]`."""

    name = "phi4_mini_json"
    marker = "functools"
