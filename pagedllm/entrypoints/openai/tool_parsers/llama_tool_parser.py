"""`llama3_json`: Llama 3.1-3.3's JSON tool calls, `{"name": ..., "parameters": {...}}` (or
"arguments"), optionally after `<|python_tag|>`, several separated by `;`. An output that does
not start with the tag or `{` is plain content (the model answered in prose)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    Split,
    ToolParser,
    strict_json_object,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import scan_calls

BOT = "<|python_tag|>"
_WS = " \t\r\n"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def split(self, text: str, finished: bool) -> Split:
        body = text.lstrip(_WS)
        offset = len(text) - len(body)
        if body.startswith(BOT):
            offset += len(BOT)
            body = text[offset:].lstrip(_WS)
            offset = len(text) - len(body)
            if not body and not finished:
                return Split([], [])
        elif not finished and BOT.startswith(body):  # "", or a prefix of the tag: wait
            return Split([], [])
        if not body.startswith("{"):
            return Split([text], [], ok=not finished)
        calls, ok = scan_calls(text, offset)
        if finished and ok:
            for c in calls:
                if not c.done or strict_json_object(text[c.start:c.end]) is None:
                    ok = False
        return Split([], calls, ok)

