"""The common interface of reasoning parsers: split a reasoning model's output into
`reasoning_content` and `content`, in full and while streaming.

Like the tool parsers, a parser only says how a text prefix splits (`split`); the full result
and the streamed deltas both come from it, so streamed `reasoning_content` / `content` deltas
add up to the non-streamed fields. The content part is what a tool parser then reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

_WS = " \t\r\n"


@dataclass
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning part
    content: str | None  # None: no content yet (still reasoning)


class ReasoningParser(ABC):
    """Subclasses set `name` (the `--reasoning-parser` value) and implement `split`.
    `keeps_special_tokens`: the tags are special tokens, decoded into the text."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False

    def for_prompt(self, prompt_text: str) -> ReasoningParser:
        """The parser for one request, given its rendered prompt (the default: this one)."""
        return self

    @abstractmethod
    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """The reasoning and the content of the text so far; while streaming, text that may
        be the start of a tag is left out of both."""

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a complete output, None for an empty part."""
        s = self.split(text, finished=True)
        return s.reasoning or None, s.content or None

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)


class ReasoningStreamer:
    """One choice's streaming state: feed the whole text so far, get (reasoning delta, the
    content so far): the content is cumulative, for the tool parser or a plain text diff."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent_reasoning = ""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        s = self.parser.split(text, finished)
        reasoning = s.reasoning or ""
        delta = ""
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            delta = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        return delta, s.content or ""
