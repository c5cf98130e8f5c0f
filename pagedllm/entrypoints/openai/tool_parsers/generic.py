"""Generic tool calling for chat templates that take no tools (llama.cpp's generic mode): the
reply is constrained to one JSON envelope, either an answer or calls,

    {"response": "the answer"}        {"tool_calls": [{"name": "add", "arguments": {"a": 2}}]}

so any model, trained for tools or not, makes calls that parse against the tools' schemas.
The tools and the envelope are described in a system message the server adds; earlier turns
(an assistant's calls, tool results) are written back in the same envelope as plain
user/assistant messages, which every template renders.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import Split, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced import lift_defs
from pagedllm.entrypoints.openai.tool_parsers.partial_json import scan_calls, value_end

_WS = " \t\r\n"
_EMPTY_OBJECT = {"type": "object", "properties": {}}
CALLS_KEY = "tool_calls"
ANSWER_KEY = "response"


def call_items(functions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(one `{"name", "arguments"}` object schema per tool, the tools' `$defs` for the root:
    forced.lift_defs)."""
    params_list, defs = lift_defs(functions)
    items = [{"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string", "enum": [f["name"]]}, "arguments": params},
              "required": ["name", "arguments"]} for f, params in zip(functions, params_list)]
    return items, defs


def generic_schema(functions: list[dict[str, Any]], parallel: bool = True, answer: bool = True) -> dict[str, Any]:
    """The envelope's JSON schema: calls (one at most unless `parallel`), or with `answer` also
    `{"response": <text>}` (tool_choice "auto"; "required" leaves only calls)."""
    items, defs = call_items(functions)
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        calls["maxItems"] = 1
    options = [{"type": "object", "additionalProperties": False, "properties": {CALLS_KEY: calls},
                "required": [CALLS_KEY]}]
    if answer:
        options.append({"type": "object", "additionalProperties": False,
                        "properties": {ANSWER_KEY: {"type": "string"}}, "required": [ANSWER_KEY]})
    schema: dict[str, Any] = {"anyOf": options} if len(options) > 1 else options[0]
    if defs:
        schema["$defs"] = defs
    return schema


def generic_system_prompt(tools: list[dict[str, Any]]) -> str:
    """What the model is told: the tools (name, description, parameters) and the envelope. The
    same whatever the turn's tool_choice, so that a tool loop's turns share their prefix (the
    prefix cache serves it) while the grammar decides what this turn may write."""
    listed = "\n".join(json.dumps({"name": t["name"], "description": t.get("description", ""),
                                   "parameters": t.get("parameters") or _EMPTY_OBJECT}, ensure_ascii=False)
                       for t in tools)
    lines = ["You can call these tools:", listed, "", "Reply with JSON only.",
             'To call tools: {"tool_calls": [{"name": <tool name>, "arguments": {<argument>: <value>}}]}',
             'To answer the user: {"response": <your answer>}',
             "When a tool_response holds what the user asked for, answer the user with it."]
    return "\n".join(lines)


def generic_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a template without tool support renders them: the tools' description
    joined to the system message (one added first if there is none; none without tools), an
    assistant's calls as their envelope, a tool result as a user message holding
    `{"tool_response": ...}`. An assistant's plain answer stays text (the model's own words are
    not rewritten)."""
    out: list[dict[str, Any]] = []
    names = {}
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", c)
                names[c.get("id")] = fn["name"]
                calls.append({"name": fn["name"], "arguments": fn.get("arguments") or {}})
            envelope = {CALLS_KEY: calls}
            out.append({"role": "assistant", "content": json.dumps(envelope, ensure_ascii=False)})
        elif role == "tool":
            result = {"tool_response": {"name": m.get("name") or names.get(m.get("tool_call_id"), ""),
                                        "content": m.get("content") or ""}}
            out.append({"role": "user", "content": json.dumps(result, ensure_ascii=False)})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if not tools:
        return out
    prompt = generic_system_prompt(tools)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _partial_string(text: str) -> tuple[str, bool]:
    """The value of the JSON string at text[0] == '"' as far as it goes (an escape cut in the
    middle is left out), and whether it is closed."""
    j, n = 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            if j + 1 >= n or (text[j + 1] == "u" and j + 6 > n):
                break
            j += 6 if text[j + 1] == "u" else 2
            continue
        if c == '"':
            return json.loads(text[:j + 1]), True
        j += 1
    try:
        return json.loads(text[:j] + '"'), False
    except ValueError:  # a lone surrogate escape cut in half
        return json.loads(text[:j - 6] + '"') if j >= 6 else "", False


class GenericToolParser(ToolParser):
    """Reads the envelope: `response` as content (streamed as the string grows), `tool_calls`
    as calls. Output that is not the envelope (only possible if the grammar was not applied)
    is content, whole."""

    name = "generic"

    def split(self, text: str, finished: bool) -> Split:
        body = text.lstrip(_WS)
        if not body:
            return Split([], [], ok=not finished)
        if not body.startswith("{"):
            return Split([text], [], ok=False)
        key_start = body.find('"', 1)
        if key_start < 0:
            return Split([], [], ok=not finished)
        colon = body.find(":", key_start)
        if colon < 0:
            return Split([], [], ok=not finished)
        try:
            key = json.loads(body[key_start:colon].strip(_WS))
        except ValueError:
            return Split([], [], ok=not finished)
        value = body[colon + 1:].lstrip(_WS)
        if key == ANSWER_KEY and value.startswith('"'):
            answer, closed = _partial_string(value)
            return Split([answer], [], ok=closed or not finished)
        if key == CALLS_KEY and value.startswith("["):
            end, closed = value_end(value, 0)
            calls, well_formed = scan_calls(value[:end], 1)
            if finished:
                well_formed = well_formed and closed and value[end:].strip(_WS) == "}"
            return Split([], calls, ok=well_formed)
        return Split([], [], ok=not finished and not value)
