"""The common interface of tool-call parsers: a full extraction and a streaming one.

A parser turns the model's text into (content outside the calls, calls). Each parser only says
how its format splits a text *prefix* (`split`); the full extraction and the streaming deltas
are both derived from that one function here, so the streamed deltas of a choice add up to
what the non-streamed response carries:

- content is the text outside the calls, concatenated, with leading and trailing whitespace cut
  (None when nothing is left);
- a call's `arguments` is the raw JSON text of its arguments object as the model wrote it;
- output the format does not parse (bad JSON, a call without a name) is left as content,
  whole: a client gets the model's text rather than a call it did not make. While streaming,
  a call whose name was already sent cannot be taken back; the rest still goes out as content.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall, final_arguments

_WS = " \t\r\n"


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class FunctionCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[FunctionCall] = field(default_factory=list)
    content: str | None = None


@dataclass
class ToolCallDelta:
    """One entry of a streamed delta's `tool_calls` (OpenAI's shape): the first for a call
    carries id, type and name (arguments ""), the later ones argument fragments only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Split:
    """What a text prefix holds: the content pieces outside calls (text that may still turn out
    to be the start of a call is left out while streaming), the calls so far, and whether the
    format parsed (in full, once `finished`)."""

    content_parts: list[str]
    calls: list[PartialCall]
    ok: bool = True


class ToolParser(ABC):
    """Subclasses set `name` (the `--tool-call-parser` value) and implement `split`.
    `keeps_special_tokens`: the format's markers are special tokens, so the output is decoded
    with them kept. `tools`: the request's functions (formats whose arguments are not JSON read
    their parameters' types)."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []

    def make_id(self) -> str:
        """A new call's id (OpenAI's `call_...` unless the format's templates need another)."""
        return make_tool_call_id()

    def template_ids(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The history as this format's template takes it (ids it would refuse mapped)."""
        return messages

    @abstractmethod
    def split(self, text: str, finished: bool) -> Split:
        """Split the model's text so far; `finished`: the text is complete."""

    def extract_tool_calls(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        """The calls of a complete output; unparsable output is all content. `truncated`: the
        output was cut by its token budget: the calls completed before the cut are calls, the
        one cut short is dropped (never returned as text), the content so far is content."""
        s = self.split(text, finished=not truncated)
        if s.ok:
            calls = _complete_calls(s.calls)
            content = "".join(s.content_parts).strip(_WS) or None
            if truncated or not s.calls:  # no call: the content as the format reads it
                return ExtractedToolCalls(bool(calls), calls, content)
            if len(calls) == len(s.calls):
                return ExtractedToolCalls(True, calls, content)
        if truncated:
            return self.extract_tool_calls(text)
        return ExtractedToolCalls(False, [], text.strip(_WS) or None)

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


def _complete_calls(calls: list[PartialCall]) -> list[FunctionCall]:
    """The leading calls that are whole (named, closed, arguments valid JSON)."""
    out = []
    for c in calls:
        if not c.done or c.name is None:
            break
        try:
            out.append(FunctionCall(c.name, final_arguments(c.args)))
        except ValueError:
            break
    return out


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


class ToolCallStreamer:
    """The streaming state of one choice: feed it the whole text so far, get the delta."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = ""
        self.sent_calls: list[_SentCall] = []

    @property
    def tools_called(self) -> bool:
        return bool(self.sent_calls)

    def feed(self, text: str, finished: bool, truncated: bool = False) -> StreamDelta:
        """`truncated`: the final text was cut by the token budget (extract_tool_calls)."""
        s = self.parser.split(text, finished and not truncated)
        delta = StreamDelta()
        if finished:
            full = self.parser.extract_tool_calls(text, truncated)
            if full.tools_called or (truncated and s.ok):
                content = full.content or ""
                calls = [c for c in s.calls if c.done] if truncated else s.calls
            elif self.sent_calls:  # too late to take the calls back
                content = "".join(s.content_parts).strip(_WS)
                calls = s.calls
            else:
                content = full.content or ""
                calls = []
        else:
            content = "".join(s.content_parts).strip(_WS)
            calls = s.calls
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            delta.content = content[len(self.sent_content):]
            self.sent_content = content
        for i, call in enumerate(calls):
            if call.name is None:
                break
            target = self._arguments(call, finished)
            if i >= len(self.sent_calls):
                # OpenAI's first delta of a call: id, type, name, arguments "" (the arguments
                # follow in later deltas; only the very last delta carries both)
                sent = _SentCall(self.parser.make_id(), target if finished else "")
                self.sent_calls.append(sent)
                delta.tool_calls.append(ToolCallDelta(i, sent.id, call.name, sent.arguments))
                continue
            sent = self.sent_calls[i]
            if target.startswith(sent.arguments) and len(target) > len(sent.arguments):
                delta.tool_calls.append(ToolCallDelta(i, arguments=target[len(sent.arguments):]))
                sent.arguments = target
        return delta

    @staticmethod
    def _arguments(call: PartialCall, finished: bool) -> str:
        """Argument text that may be sent now: an object's raw text as it grows; any other
        value (or none) only once the call is complete."""
        if call.args.startswith("{"):
            return call.args
        if call.done or (finished and call.args_done):
            try:
                return final_arguments(call.args)
            except ValueError:
                return ""
        return ""


def partial_prefix_len(text: str, token: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `token` (held back while
    streaming: they may be the start of the token)."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


def strict_json_object(raw: str) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
