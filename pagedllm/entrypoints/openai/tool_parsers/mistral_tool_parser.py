"""`mistral`: Mistral's `[TOOL_CALLS]` in both of its forms, content before it:

- tokenizer v3 (Mistral 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`;
- tokenizer v11+ (Small 3.2, Devstral, Ministral 3): `[TOOL_CALLS]name[ARGS]{...}` (or
  `name[CALL_ID]id[ARGS]{...}`), each call behind its own `[TOOL_CALLS]`.

Mistral's templates refuse a tool-call id that is not 9 letters and digits, so this format's
ids are made that way (`make_id`), and ids of other shapes in the history are mapped to such ids
before the template sees them (`template_ids`)."""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    Split,
    ToolParser,
    strict_json_object,
)
from pagedllm.entrypoints.openai.tool_parsers.marker_json import content_until, json_calls
from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall, value_end

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_WS = " \t\r\n"
_ALNUM = string.ascii_letters + string.digits


def mistral_id(seed: str | None = None) -> str:
    """9 letters and digits: random, or derived from `seed` (an id of another shape, mapped the
    same way every turn so the prompt's prefix stays the same)."""
    if seed is None:
        return "".join(random.choices(_ALNUM, k=9))
    digest = hashlib.sha256(seed.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


def _is_mistral_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 9 and value.isalnum() and value.isascii()


class MistralToolParser(ToolParser):
    name = "mistral"

    def make_id(self) -> str:
        return mistral_id()

    def template_ids(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The history with every tool-call id of another shape mapped to 9 letters and digits."""
        def fix(value: Any) -> Any:
            return value if value is None or _is_mistral_id(value) else mistral_id(str(value))

        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "id": fix(c.get("id"))} for c in m["tool_calls"]]}
            if m.get("tool_call_id") is not None:
                m = {**m, "tool_call_id": fix(m["tool_call_id"])}
            out.append(m)
        return out

    def split(self, text: str, finished: bool) -> Split:
        content, start = content_until(text, MARKER, finished)
        if start < 0:
            return Split([content], [])
        if text[start:].lstrip(_WS)[:1] in ("[", "{"):  # v3: a JSON array after the marker
            found = json_calls(text, start, finished)
            return Split([content], found.calls, found.ok)
        calls: list[PartialCall] = []
        pos = start
        while True:  # v11: name[ARGS]{...}, then [TOOL_CALLS] for the next one
            a = text.find(ARGS, pos)
            if a < 0:
                return Split([content], calls, ok=not finished)
            name = text[pos:a].split(CALL_ID)[0].strip(_WS)
            body = a + len(ARGS)
            while body < len(text) and text[body] in _WS:
                body += 1
            call = PartialCall(name=name or None, start=pos, end=len(text))
            calls.append(call)
            if body >= len(text):
                return Split([content], calls, ok=not finished)
            if text[body] != "{":
                return Split([content], calls, ok=False)
            end, closed = value_end(text, body)
            call.args, call.args_done = text[body:end].rstrip(_WS), closed
            if not closed:
                return Split([content], calls, ok=not finished)
            call.done, call.end = True, end
            if strict_json_object(call.args) is None or not name:
                return Split([content], calls, ok=False)
            rest = text[end:].lstrip(_WS)
            if not rest:
                return Split([content], calls)
            if rest.startswith(MARKER):
                pos = len(text) - len(rest) + len(MARKER)
                continue
            if not finished and MARKER.startswith(rest):
                return Split([content], calls)
            return Split([content], calls, ok=False)
