"""What a chat request's `tools` / `tool_choice` and the server's `--tool-call-parser` /
`--reasoning-parser` make of the model's output (docs/tool_calling.md).

- "none": the tools are still shown to the template; the output is text.
- "auto": the output is parsed by the server's tool parser (`--enable-auto-tool-choice
  --tool-call-parser NAME`; without them it is a 400 naming the flags, as vLLM does).
- "required" / a named function: structured output forces the calls (a JSON schema built from
  the tools' parameters), so any model makes them; the JSON is parsed into `tool_calls`.

The reasoning parser (if any) splits `reasoning_content` off first; the tool parser reads the
content part. A forced output has no reasoning part (the grammar applies from the first
token), so it is not given to the reasoning parser.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStreamer,
    get_reasoning_parser,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    named_tool_schema,
    required_tool_schema,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclass
class ToolConfig:
    """The server's tool and reasoning settings (from the CLI flags)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set.")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)


@dataclass
class ToolPlan:
    """How one request's outputs are read."""

    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    schema: dict[str, Any] | None = None  # forced calls: the structured-output JSON schema
    parallel: bool = True
    include_reasoning: bool = True

    def choice_parser(self) -> ChoiceParser:
        return ChoiceParser(self)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """The sampling params with the forcing schema (if any) as structured output."""
        if self.schema is None:
            return params
        if getattr(params, "structured_outputs", None) is not None:
            raise OpenAIError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format / structured_outputs (both constrain the output).", 400,
                param="tool_choice")
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
            json=self.schema))


def plan_tools(request: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """The request's plan; a combination the server cannot honour is a 400 that names it."""
    reasoning = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
    plan = ToolPlan(reasoning_parser=reasoning, parallel=request.parallel_tool_calls is not False,
                    include_reasoning=request.include_reasoning)
    choice = request.tool_choice
    tools = request.tools or []
    if choice == "none":
        return plan
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise OpenAIError(AUTO_NEEDS_FLAGS, 400, param="tool_choice")
        for i, t in enumerate(tools):
            if t.function.strict:
                raise OpenAIError(
                    f"tools[{i}].function.strict=true is not enforced with tool_choice 'auto' "
                    "(the model's text is parsed, not constrained); use tool_choice 'required' "
                    "or a named function, which are enforced by the tool's schema.", 400,
                    param="tools")
        plan.tool_parser = get_tool_parser(config.tool_call_parser)
        return plan
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        (function,) = [f for f in functions if f["name"] == choice.function.name][:1]
        plan.tool_parser = NamedToolParser(function["name"])
        plan.schema = named_tool_schema(function)
    else:  # "required"
        plan.tool_parser = RequiredToolParser()
        try:
            plan.schema = required_tool_schema(functions, parallel=plan.parallel)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param="tools") from None
    plan.reasoning_parser = None  # the grammar forces JSON from the first token
    return plan


@dataclass
class ParsedOutput:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


class ChoiceParser:
    """One choice's reading of the model's text, in full or as stream deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        rp, tp = plan.reasoning_parser, plan.tool_parser
        self._reasoning: ReasoningStreamer | None = rp.streamer() if rp else None
        self._tools: ToolCallStreamer | None = tp.streamer() if tp else None
        self._sent_content = 0

    @property
    def active(self) -> bool:
        """False: the text passes through untouched (no parser applies)."""
        return self._reasoning is not None or self._tools is not None

    @property
    def tools_called(self) -> bool:
        return self._tools is not None and self._tools.tools_called

    def full(self, text: str) -> ParsedOutput:
        plan = self.plan
        reasoning, content = None, text
        if plan.reasoning_parser is not None:
            reasoning, content = plan.reasoning_parser.extract_reasoning(text)
            if not plan.include_reasoning:
                reasoning = None
        out = ParsedOutput(content=content, reasoning_content=reasoning)
        if plan.tool_parser is not None and content:
            extracted = plan.tool_parser.extract_tool_calls(content)
            out.content = extracted.content
            calls = extracted.tool_calls if plan.parallel else extracted.tool_calls[:1]
            out.tool_calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                              for c in calls]
        return out

    def delta(self, text: str, finished: bool) -> ParsedDelta:
        """The delta for the whole text so far (`finished`: it is the final text)."""
        out = ParsedDelta()
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, finished)
            if self.plan.include_reasoning:
                out.reasoning_content = reasoning
        if self._tools is None:
            out.content = content[self._sent_content:]
            self._sent_content = max(self._sent_content, len(content))
            return out
        d = self._tools.feed(content, finished)
        out.content = d.content
        out.tool_calls = [tc.to_dict() for tc in d.tool_calls
                          if self.plan.parallel or tc.index == 0]
        return out


def finish_reason(reason: str | None, tools_called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended normally with calls."""
    return "tool_calls" if tools_called and reason == "stop" else reason
