"""Reasoning parsers, chosen by `--reasoning-parser` (vLLM's names): they split
`reasoning_content` from `content` in chat responses and streamed deltas."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
)
from pagedllm.entrypoints.openai.reasoning_parsers.deepseek_r1_reasoning_parser import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name`; an unknown name is a ValueError listing the known."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}."
        ) from None


__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "REASONING_PARSERS",
           "ReasoningParser", "ReasoningSplit", "ReasoningStreamer", "get_reasoning_parser"]
