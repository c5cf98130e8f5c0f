"""A scanner for tool-call JSON that may still be growing (streaming) or be cut short.

Tool calls arrive as JSON objects `{"name": ..., "arguments"|"parameters": {...}}`, alone, in a
`[...]` array, or several separated by `;` / `,`. The scanner reads such a text *prefix* and
reports, per object, the name once its string is closed and the raw text of the arguments
value as far as it goes. Streaming sends the arguments as those raw fragments, and the full
(non-streamed) parse uses the same raw text, so the concatenated deltas equal the final
`arguments` string exactly. No JSON is re-serialised, so nothing is re-ordered or re-spaced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


@dataclass
class PartialCall:
    """One call object as far as the text goes."""

    name: str | None = None  # set once the name's string is closed
    args: str = ""  # raw JSON text of the arguments value so far (trailing space cut)
    args_done: bool = False  # the arguments value is complete
    done: bool = False  # the object's closing brace was seen
    start: int = 0  # index of the object's opening brace
    end: int = 0  # index just past the object (once done)


def _string_end(text: str, i: int) -> int | None:
    """Index just past the string starting at text[i] == '"'; None if it is not closed."""
    j = i + 1
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> tuple[int, bool]:
    """(index reached, complete) for the JSON value starting at text[i]."""
    n = len(text)
    c = text[i]
    if c == '"':
        end = _string_end(text, i)
        return (n, False) if end is None else (end, True)
    if c in "{[":
        depth = 0
        j = i
        while j < n:
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return n, False
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1, True
            j += 1
        return n, False
    j = i  # a number, true, false, null: complete only once a delimiter follows
    while j < n and text[j] not in ",}]" + _WS:
        j += 1
    return j, j < n


def scan_calls(text: str, start: int = 0) -> tuple[list[PartialCall], bool]:
    """The call objects in text[start:] and whether the text is well-formed so far.

    Between objects, whitespace and `[ ] , ;` are skipped. Anything else outside an object, or
    a member that is not `"key": value`, makes the text malformed (the caller then leaves it
    as content)."""
    calls: list[PartialCall] = []
    n = len(text)
    i = start
    while i < n:
        c = text[i]
        if c in _WS or c in "[],;":
            i += 1
            continue
        if c != "{":
            return calls, False
        call = PartialCall(start=i, end=n)
        calls.append(call)
        i += 1
        while True:
            while i < n and (text[i] in _WS or text[i] == ","):
                i += 1
            if i >= n:
                return calls, True
            if text[i] == "}":
                i += 1
                call.done, call.end = True, i
                break
            if text[i] != '"':
                return calls, False
            key_end = _string_end(text, i)
            if key_end is None:
                return calls, True
            key = json.loads(text[i:key_end])
            i = key_end
            while i < n and text[i] in _WS:
                i += 1
            if i >= n:
                return calls, True
            if text[i] != ":":
                return calls, False
            i += 1
            while i < n and text[i] in _WS:
                i += 1
            if i >= n:
                return calls, True
            v_start = i
            v_end, complete = value_end(text, i)
            if key == "name":
                if complete:
                    name = json.loads(text[v_start:v_end])
                    if not isinstance(name, str):
                        return calls, False
                    call.name = name
            elif key in ARGUMENT_KEYS:
                call.args = text[v_start:v_end].rstrip(_WS)
                call.args_done = complete
            if not complete:
                return calls, True
            i = v_end
    return calls, True


def final_arguments(raw: str) -> str:
    """The `arguments` string of a complete call: the raw object text as the model wrote it;
    an arguments value written as a JSON string is that string; none at all is `{}`."""
    if not raw:
        return "{}"
    value = json.loads(raw)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return raw
    return json.dumps(value, ensure_ascii=False)
