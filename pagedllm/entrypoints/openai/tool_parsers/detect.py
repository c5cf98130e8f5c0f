"""Which tool-call format a chat template speaks, read from the template itself (as llama.cpp's
server does), so that `tool_choice: "auto"` works with no flags.

A template *takes tools* when it reads the `tools` variable (jinja2's own analysis of the
parsed template, not a substring test). Its format is then told by the call markers it writes
for an assistant's `tool_calls`; a template that takes no tools, or whose markers no parser
knows, gets the generic mode (tool_parsers/generic.py).
"""

from __future__ import annotations

import functools

import jinja2
import jinja2.meta

# (marker the template writes, parser name), first match wins: the more specific markers first
# (Qwen3-Coder's XML calls sit inside `<tool_call>` too).
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>ipython", "llama3_json"),
    ("\"parameters\": ", "llama3_json"),
)


@functools.lru_cache(maxsize=16)
def template_takes_tools(template: str | None) -> bool:
    """True when the template reads `tools` (a template that fails to parse: False)."""
    if not template:
        return False
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False
    return "tools" in names


def parser_for_template(template: str | None, known: frozenset[str] | set[str]) -> str | None:
    """The registered parser whose markers the template writes; None: generic mode."""
    if not template_takes_tools(template):
        return None
    for marker, name in _MARKERS:
        if marker in template and name in known:
            return name
    return None
