"""Parsers of the outputs that structured output forces for `tool_choice="required"` and for a
named function, and the JSON schemas that force them (vLLM's shapes):

- "required": a JSON array of at least one `{"name": <one of the tools>, "parameters": {...}}`
  (at most one with `parallel_tool_calls: false`), each item's parameters validated by its
  tool's schema;
- a named function: the output is that function's arguments object itself.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    Split,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall, scan_calls

_WS = " \t\r\n"
_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or dict(_EMPTY_OBJECT)


def named_tool_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The schema of a named function's output: its parameters (an empty object if none)."""
    return _parameters(function)


def lift_defs(functions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(each tool's parameters schema without its `$defs`, every tool's `$defs` together): a schema
    built of several tools keeps them at its root, where `#/$defs/...` references find them. Two
    tools defining one name differently are a ValueError (the request's 400)."""
    params_list, defs = [], {}
    for f in functions:
        params = dict(_parameters(f))
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"Tool definitions define `$defs` entry {key!r} differently.")
            defs[key] = value
        params_list.append(params)
    return params_list, defs


def required_tool_schema(functions: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The schema of a "required" output: an array of calls to any of the functions, their
    `$defs` at the top (`lift_defs`)."""
    params_list, defs = lift_defs(functions)
    items = [{"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": params},
              "required": ["name", "parameters"]} for f, params in zip(functions, params_list)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolParser(ToolParser):
    """The forced array of "required": every element is a call; nothing is content."""

    name = "required"

    def split(self, text: str, finished: bool) -> Split:
        calls, ok = scan_calls(text)
        if finished:
            body = text.strip(_WS)
            ok = ok and body.startswith("[") and body.endswith("]") and bool(calls)
        return Split([], calls, ok)


class NamedToolParser(ToolParser):
    """The forced arguments object of a named function: one call, named up front."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def split(self, text: str, finished: bool) -> Split:
        body = text.strip(_WS)
        call = PartialCall(name=self.function_name, args=body)
        if finished:
            call.done = call.args_done = True
            return Split([], [call], ok=body.startswith("{"))
        return Split([], [call])
