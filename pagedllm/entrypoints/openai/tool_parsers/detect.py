"""Which tool-call format a chat template speaks, read from the template itself (as llama.cpp's
server does), so that `tool_choice: "auto"` works with no flags.

The format is told by the call markers the template writes for an assistant's `tool_calls`; a
template that writes none a parser knows gets the generic mode (tool_parsers/generic.py). A
template *takes tools* when it reads the `tools` variable (jinja2's own analysis of the parsed
template, not a substring test).
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
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "granite"),
    ("functools[", "phi4_mini_json"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>ipython", "llama3_json"),
    ("\"parameters\": ", "llama3_json"),
    ("<|python_start|>", "pythonic"),
    ("[func_name1(", "pythonic"),
)


@functools.lru_cache(maxsize=16)
def template_takes_tools(template: str | None) -> bool:
    """True when the template reads `tools` (a template that fails to parse: False)."""
    if not template:
        return False
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template))
    except jinja2.TemplateError:  # tags jinja2 alone does not know (transformers adds some)
        return "tools" in template
    return "tools" in names


def parser_for_template(template: str | None, known: frozenset[str] | set[str]) -> str | None:
    """The registered parser whose markers the template writes (for an assistant's calls; a
    template may write them without reading `tools`, as DeepSeek V3.1's does: the model was
    trained on that format all the same); None: generic mode."""
    if not template:
        return None
    for marker, name in _MARKERS:
        if marker in template and name in known:
            return name
    return None
