"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro,
Qwen2.5 and Qwen3 chat templates). Text around the tags is content; a last call whose closing
tag never came (the output was stopped right after it) still counts if its JSON is whole."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    Split,
    ToolParser,
    partial_prefix_len,
    strict_json_object,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import scan_calls

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def split(self, text: str, finished: bool) -> Split:
        parts: list[str] = []
        calls = []
        ok = True
        i = 0
        while True:
            j = text.find(START, i)
            if j < 0:
                tail = text[i:]
                if not finished:
                    tail = tail[:len(tail) - partial_prefix_len(tail, START)]
                parts.append(tail)
                break
            parts.append(text[i:j])
            k = j + len(START)
            e = text.find(END, k)
            inner = text[k:] if e < 0 else text[k:e]
            found, well_formed = scan_calls(inner)
            if e >= 0 or finished:  # the call is whole: it must be exactly one JSON object
                obj = strict_json_object(inner)
                if obj is None or len(found) != 1 or not well_formed:
                    ok = False
            calls.extend(found[:1])
            if e < 0:
                break
            i = e + len(END)
        return Split(parts, calls, ok)
