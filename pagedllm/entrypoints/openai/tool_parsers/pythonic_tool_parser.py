"""`pythonic`: calls written as a Python list of calls, `[get_weather(city="Paris"), add(a=1,
b=2)]` (Llama 3.2 / 4's pythonic templates, many small models), optionally between Llama 4's
`<|python_start|>` and `<|python_end|>`. The list is read with Python's own parser (literals
only: nothing is evaluated); the calls are sent once the list is closed. An output that does
not start with `[` is content."""

from __future__ import annotations

import ast
import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import Split, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall

START, END = "<|python_start|>", "<|python_end|>"
_WS = " \t\r\n"


def _calls(source: str) -> list[PartialCall] | None:
    """The calls of a complete list; None when it is not a list of calls with literal keyword
    arguments."""
    try:
        tree = ast.parse(source.strip(_WS), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    out = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        out.append(PartialCall(name=ast.unparse(node.func), args=json.dumps(args, ensure_ascii=False),
                               args_done=True, done=True))
    return out


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def split(self, text: str, finished: bool) -> Split:
        body = text.strip(_WS)
        if body.startswith(START):
            body = body[len(START):]
            body = body[:-len(END)] if body.endswith(END) else body
        elif not finished and START.startswith(body):
            return Split([], [])
        if not body.startswith("["):
            return Split([text], [], ok=not finished)
        calls = _calls(body)
        if calls is None:  # not closed yet (streaming), or not calls (finished)
            return Split([], [PartialCall()] if not finished else [], ok=not finished)
        return Split([], calls)
