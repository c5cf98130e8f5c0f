"""`deepseek_v3`: DeepSeek V3 / V3.1 / R1 calls between special tokens, content before them:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

V3-0324 and R1 write `function<｜tool▁sep｜>NAME` and the arguments in a ```json block instead;
both are read. The markers are special tokens: the output is decoded with them kept."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    Split,
    ToolParser,
    strict_json_object,
)
from pagedllm.entrypoints.openai.tool_parsers.marker_json import content_until
from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
_WS = " \t\r\n"


def _name_and_args(header: str, body: str) -> tuple[str, str]:
    """(name, raw JSON arguments) of one call's header and body (either style)."""
    header = header.strip(_WS)
    if header != "function":
        return header, body.strip(_WS)
    name, _, rest = body.partition("\n")
    rest = rest.strip(_WS)
    if rest.startswith("```json"):
        rest = rest[len("```json"):]
    if rest.endswith("```"):
        rest = rest[:-3]
    return name.strip(_WS), rest.strip(_WS)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True

    def split(self, text: str, finished: bool) -> Split:
        content, pos = content_until(text, CALLS_BEGIN, finished)
        if pos < 0:
            return Split([content], [])
        calls: list[PartialCall] = []
        while True:
            rest = text[pos:].lstrip(_WS)
            pos = len(text) - len(rest)
            if not rest or rest.startswith(CALLS_END) or (not finished and CALL_BEGIN.startswith(rest)):
                ok = bool(calls) and (rest.startswith(CALLS_END) or not finished)
                tail = rest[len(CALLS_END):].strip(_WS) if rest.startswith(CALLS_END) else ""
                return Split([content, tail], calls, ok=ok or not finished)
            if not rest.startswith(CALL_BEGIN):
                return Split([content], calls, ok=False)
            start = pos + len(CALL_BEGIN)
            sep = text.find(SEP, start)
            end = text.find(CALL_END, start)
            if sep < 0 or end < 0:  # still being written: nothing of it is sent yet
                calls.append(PartialCall(start=pos, end=len(text)))
                return Split([content], calls, ok=not finished)
            name, args = _name_and_args(text[start:sep], text[sep + len(SEP):end])
            if not name or strict_json_object(args) is None:
                return Split([content], calls, ok=False)
            calls.append(PartialCall(name=name, args=args, args_done=True, done=True, start=pos,
                                     end=end + len(CALL_END)))
            pos = end + len(CALL_END)
