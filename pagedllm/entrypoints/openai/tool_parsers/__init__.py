"""Tool-call parsers for `tool_choice="auto"`, chosen from the chat template (detect.py) or by
`--tool-call-parser`: one module per format, registered here by vLLM's names (and `generic`,
llama.cpp's mode for templates without tools). See abstract_tool_parser.py for the interface and
docs/tool_calling.md for the formats."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    FunctionCall,
    StreamDelta,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
    make_tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_tool_schema,
    required_tool_schema,
)
from pagedllm.entrypoints.openai.tool_parsers.deepseek_v3_tool_parser import DeepSeekV3ToolParser
from pagedllm.entrypoints.openai.tool_parsers.generic import GenericToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.marker_json import GraniteToolParser, Phi4MiniToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder_tool_parser import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    GenericToolParser, HermesToolParser, Llama3JsonToolParser, Qwen3CoderToolParser, MistralToolParser,
    GraniteToolParser, Phi4MiniToolParser, DeepSeekV3ToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; an unknown name is a ValueError listing the known."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}."
        ) from None


__all__ = [
    "ExtractedToolCalls", "FunctionCall", "GenericToolParser", "HermesToolParser", "Llama3JsonToolParser",
    "NamedToolParser", "RequiredToolParser", "StreamDelta", "TOOL_PARSERS", "ToolCallDelta",
    "ToolCallStreamer", "ToolParser", "get_tool_parser", "make_tool_call_id",
    "named_tool_schema", "required_tool_schema",
]
