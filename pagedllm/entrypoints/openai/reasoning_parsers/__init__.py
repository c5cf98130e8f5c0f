"""Reasoning parsers, chosen from the chat template's reasoning tags or by `--reasoning-parser`
(vLLM's names): they split `reasoning_content` from `content` in chat responses and streamed
deltas."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
)
from pagedllm.entrypoints.openai.reasoning_parsers.deepseek_r1_reasoning_parser import (
    DeepSeekR1ReasoningParser,
    MistralReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    DeepSeekR1ReasoningParser, Qwen3ReasoningParser, MistralReasoningParser)}


def reasoning_parser_for_template(template: str | None) -> str | None:
    """The reasoning parser a thinking template needs (its reasoning tags), None for others.
    `<think>` templates get `qwen3`; whether a request's output starts inside the reasoning is
    read from its prompt (DeepSeekR1ReasoningParser.for_prompt)."""
    if not template:
        return None
    if "[THINK]" in template:
        return MistralReasoningParser.name
    if "<think>" in template or "</think>" in template:
        return Qwen3ReasoningParser.name
    return None


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name`; an unknown name is a ValueError listing the known."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}."
        ) from None


__all__ = ["DeepSeekR1ReasoningParser", "MistralReasoningParser", "Qwen3ReasoningParser", "REASONING_PARSERS",
           "ReasoningParser", "ReasoningSplit", "ReasoningStreamer", "get_reasoning_parser",
           "reasoning_parser_for_template"]
