"""`qwen3_coder`: Qwen3-Coder's (and Qwen3.5's, Nemotron 3's) XML calls, content before them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes JSON by its type in the tool's schema (a string stays
text, a number / boolean / object / array is read as JSON), or by what it reads as when the
schema does not say. A call's arguments are sent once the call is closed."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import Split, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.marker_json import content_until
from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_WS = " \t\r\n"


def _value(raw: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def _param_schema(self, function: str, param: str) -> dict[str, Any] | None:
        for tool in self.tools:
            if tool.get("name") == function:
                return ((tool.get("parameters") or {}).get("properties") or {}).get(param)
        return None

    def split(self, text: str, finished: bool) -> Split:
        parts, calls = [], []
        pos = 0
        while True:
            content, start = content_until(text[pos:], START, finished)
            parts.append(content)
            if start < 0:
                return Split(parts, calls)
            start += pos
            end = text.find(END, start)
            if end < 0:
                calls.append(PartialCall(start=start, end=len(text)))
                return Split(parts, calls, ok=not finished)
            m = _FUNCTION.match(text[start:end])
            if m is None:
                return Split(parts, calls, ok=False)
            name = m.group(1).strip(_WS)
            args = {p.strip(_WS): _value(v, self._param_schema(name, p.strip(_WS)))
                    for p, v in _PARAM.findall(m.group(2))}
            calls.append(PartialCall(name=name, args=json.dumps(args, ensure_ascii=False), args_done=True,
                                     done=True, start=start, end=end + len(END)))
            pos = end + len(END)
