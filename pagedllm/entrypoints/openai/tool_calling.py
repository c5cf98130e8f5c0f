"""What a chat request's `tools` / `tool_choice` and the server's tool and reasoning settings
make of the model's output (docs/tool_calling.md).

Tool calls are on with no flags: the tool-call format is read from the chat template
(tool_parsers/detect.py: the markers it writes), and a template that takes no tools gets the
generic mode (tool_parsers/generic.py: the reply constrained to an answer-or-calls JSON envelope,
the tools described in a system message), as llama.cpp's server does. `--tool-call-parser`
(with or without vLLM's `--enable-auto-tool-choice`) overrides the choice.

- "none": the tools are still shown to the template; the output is text.
- "auto": the output is parsed by the format's parser; a tool with `strict: true` makes the
  calls constrained once the model opens one with its marker (xgrammar's structural tag for the
  format, free text around the calls); generic mode constrains every reply.
- "required" / a named function: structured output forces the calls (a JSON schema built from
  the tools' parameters), so any model makes them; the JSON is parsed into `tool_calls`.

Constrained call JSON is written with the canonical separators only (`{"a": 2, "b": 3}`:
vLLM's `disable_any_whitespace`), so a small model cannot spend its budget on whitespace;
`--tool-call-any-whitespace` allows any. A reply cut by `max_tokens` keeps its complete calls.
The reasoning parser (if any) splits `reasoning_content` off first; the tool parser reads the
content part. A forced output has no reasoning part (the grammar applies from the first
token), so it is not given to the reasoning parser.
"""

from __future__ import annotations

import dataclasses
import logging
import re
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
    reasoning_parser_for_template,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    GenericToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    named_tool_schema,
    required_tool_schema,
)
from pagedllm.entrypoints.openai.tool_parsers.detect import parser_for_template
from pagedllm.entrypoints.openai.tool_parsers.generic import generic_conversation, generic_schema
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The parsers whose calls xgrammar's built-in structural tags describe (its format names):
# strict tools under tool_choice "auto" are constrained through them.
STRICT_FORMATS = {"hermes": "qwen_3", "llama3_json": "llama", "qwen3_coder": "qwen_3_coder"}


@dataclass
class ToolConfig:
    """The server's tool and reasoning settings: the CLI flags, and `auto_parser`, the format
    "auto" reads (`for_template`: the flag's, or the one the chat template speaks)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    any_whitespace: bool = False  # --tool-call-any-whitespace
    auto_parser: str | None = None
    auto_reasoning_parser: str | None = None  # the template's reasoning tags' parser

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set.")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)

    def for_template(self, chat_template: str | None, log: bool = True) -> ToolConfig:
        """This config with `auto_parser` chosen for a chat template: the server's (logged once)
        or a request's own (`log` False)."""
        chosen = self.tool_call_parser
        why = "--tool-call-parser"
        if chosen is None:
            chosen = parser_for_template(chat_template, frozenset(TOOL_PARSERS)) or GenericToolParser.name
            why = ("the chat template's tool-call markers" if chosen != GenericToolParser.name else
                   "the chat template takes no tools (or writes no call markers a parser knows): replies "
                   "to requests with tools are constrained to an answer-or-calls JSON envelope")
        reasoning = reasoning_parser_for_template(chat_template)
        if log:
            logger.info("tool calls: %s parser (%s)", chosen, why)
            if self.reasoning_parser is None and reasoning is not None:
                logger.info("reasoning: %s parser (the chat template's reasoning tags; "
                            "--reasoning-parser overrides)", reasoning)
        return dataclasses.replace(self, auto_parser=chosen, auto_reasoning_parser=reasoning)

    @property
    def reasoning(self) -> str | None:
        """The reasoning parser: the flag's, else the one the template's tags need."""
        return self.reasoning_parser or self.auto_reasoning_parser

    @property
    def format(self) -> str:
        """The parser "auto" uses: chosen for the template, else the flag's, else generic."""
        return self.auto_parser or self.tool_call_parser or GenericToolParser.name

    @property
    def generic(self) -> bool:
        return self.format == GenericToolParser.name


@dataclass
class ToolPlan:
    """How one request's outputs are read."""

    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    schema: dict[str, Any] | None = None  # forced calls / generic mode: the JSON schema
    structural_tag: dict[str, Any] | None = None  # strict tools under "auto"
    any_whitespace: bool = False
    parallel: bool = True
    include_reasoning: bool = True
    # generic mode: the tools described in a system message, earlier calls as envelopes
    generic_tools: list[dict[str, Any]] | None = None
    history_parser: ToolParser | None = None  # the template's format: its ids in the history

    def choice_parser(self) -> ChoiceParser:
        return ChoiceParser(self)

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages the template renders (generic mode: rewritten, generic.py)."""
        if self.generic_tools is not None:
            return generic_conversation(messages, self.generic_tools)
        return self.history_parser.template_ids(messages) if self.history_parser else messages

    def for_prompt(self, prompt_text: str) -> None:
        """Once the prompt is rendered: whether the output starts inside the reasoning."""
        if self.reasoning_parser is not None:
            self.reasoning_parser = self.reasoning_parser.for_prompt(prompt_text)

    def apply(self, params: SamplingParams) -> SamplingParams:
        """The sampling params with the calls' constraint (if any) as structured output, and
        special tokens kept in the text when the format's markers are special tokens."""
        keeps = any(p is not None and p.keeps_special_tokens for p in (self.tool_parser, self.reasoning_parser))
        if keeps and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        if self.schema is None and self.structural_tag is None:
            return params
        if getattr(params, "structured_outputs", None) is not None:
            raise OpenAIError(
                "tool calls constrained by the tools' schemas (tool_choice 'required', a named "
                "function, strict tools, or tools on a model whose template takes none) cannot be "
                "combined with response_format / structured_outputs (both constrain the output).",
                400, param="tool_choice")
        if self.structural_tag is not None:
            so = StructuredOutputsParams(structural_tag=self.structural_tag)
        else:
            so = StructuredOutputsParams(json=self.schema, disable_any_whitespace=not self.any_whitespace)
        return dataclasses.replace(params, structured_outputs=so)


def _strict_tag(parser: str, tools: list[dict[str, Any]], parallel: bool, reasoning: bool) -> dict[str, Any]:
    """xgrammar's structural tag for the format: free text, then each call opened by the
    format's marker constrained to a tool's name and arguments schema."""
    from xgrammar.builtin_structural_tag import get_model_structural_tag  # lazy: 2 s import

    tag = get_model_structural_tag(STRICT_FORMATS[parser], tools=tools, tool_choice="auto",
                                   reasoning=reasoning, parallel_tool_calls=parallel)
    return tag.model_dump(mode="json", exclude_none=True)


# OpenAI's limits on function tools: names of 1-64 letters, digits, `_` and `-` (`.` too: builtin
# and MCP tools are written `server.tool`), 128 tools a request, 5,000 object properties in all
# the schemas (its structured-output limit; a bigger one would not fit a small model's context).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
MAX_TOOL_PROPERTIES = 5000


def _count_properties(schema: Any) -> int:
    """Object properties declared anywhere in a JSON schema (iterative: no recursion limit)."""
    total, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                total += len(props)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total


def check_tools(tools: list[Any]) -> None:
    """OpenAI's limits on `tools`, a 400 naming the field (before any template or grammar)."""
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(f"`tools` has {len(tools)} tools; at most {MAX_TOOLS} are allowed.", 400,
                          param="tools")
    properties = 0
    for i, t in enumerate(tools):
        name = t.function.name
        if not _TOOL_NAME.fullmatch(name):
            shown = name if len(name) <= 80 else name[:80] + f"... ({len(name)} characters)"
            raise OpenAIError(f"`tools[{i}].function.name` {shown!r} is invalid: 1 to 64 letters, digits, "
                              "underscores, dashes or dots.", 400, param=f"tools[{i}].function.name")
        properties += _count_properties(t.function.parameters)
        if properties > MAX_TOOL_PROPERTIES:
            raise OpenAIError(f"`tools[{i}].function.parameters`: the tools' schemas declare more than "
                              f"{MAX_TOOL_PROPERTIES} object properties in all.", 400,
                              param=f"tools[{i}].function.parameters")


def plan_tools(request: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """The request's plan; a combination the server cannot honour is a 400 that names it."""
    check_tools(request.tools or [])
    reasoning = get_reasoning_parser(config.reasoning) if config.reasoning else None
    # parallel_tool_calls unset: several calls a reply where the model writes its own format
    # freely ("auto" with a parser); one where the server's grammar shapes the calls (generic
    # mode, "required"): asked for an open-ended array, a small model repeats its call until
    # max_tokens (SmolLM2, "required" as an array: 1,839 tokens for one add(2, 3)), and
    # llama.cpp's generic mode defaults to one call too
    parallel = request.parallel_tool_calls
    if parallel is None:
        parallel = request.tool_choice == "auto" and not config.generic
    plan = ToolPlan(reasoning_parser=reasoning, parallel=parallel,
                    include_reasoning=request.include_reasoning, any_whitespace=config.any_whitespace)
    choice = request.tool_choice
    tools = request.tools or []
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    generic = config.generic
    if generic:  # the tools described, earlier calls as envelopes: the same prompt every turn
        plan.generic_tools = functions
    else:
        plan.history_parser = get_tool_parser(config.format)
    if choice == "none":
        return plan
    if choice == "required" and len(functions) == 1 and not plan.parallel:
        # one call to the one tool: only its arguments are left to write (13 tokens for
        # add(a=2, b=3) on SmolLM2 instead of 32 in the envelope)
        choice = ChatCompletionNamedToolChoiceParam(function={"name": functions[0]["name"]})
    if generic and not isinstance(choice, ChatCompletionNamedToolChoiceParam):
        plan.tool_parser = GenericToolParser()
        try:
            plan.schema = generic_schema(functions, plan.parallel, answer=choice == "auto")
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param="tools") from None
        plan.reasoning_parser = None  # the envelope is forced from the first token
        return plan
    if choice == "auto":
        plan.tool_parser = plan.history_parser
        plan.tool_parser.tools = functions
        strict = [i for i, t in enumerate(tools) if t.function.strict]
        if strict:
            if config.format not in STRICT_FORMATS:
                raise OpenAIError(
                    f"tools[{strict[0]}].function.strict=true cannot be enforced with tool_choice "
                    f"'auto' by the {config.format!r} tool-call format (it has no call marker "
                    f"that opens a constrained call; formats that do: {sorted(STRICT_FORMATS)}); use "
                    "tool_choice 'required' or a named function, or drop strict.", 400, param="tools")
            plan.structural_tag = _strict_tag(config.format, [t.model_dump(exclude_none=True) for t in tools],
                                              plan.parallel, reasoning is not None)
        return plan
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

    def full(self, text: str, truncated: bool = False) -> ParsedOutput:
        """`truncated`: the text was cut by its token budget (complete calls stay calls)."""
        plan = self.plan
        reasoning, content = None, text
        if plan.reasoning_parser is not None:
            reasoning, content = plan.reasoning_parser.extract_reasoning(text)
            if not plan.include_reasoning:
                reasoning = None
        out = ParsedOutput(content=content, reasoning_content=reasoning)
        if plan.tool_parser is not None and content:
            extracted = plan.tool_parser.extract_tool_calls(content, truncated)
            out.content = extracted.content
            calls = extracted.tool_calls if plan.parallel else extracted.tool_calls[:1]
            out.tool_calls = [ToolCall(id=plan.tool_parser.make_id(),
                                       function=FunctionCall(name=c.name, arguments=c.arguments))
                              for c in calls]
        return out

    def delta(self, text: str, finished: bool, truncated: bool = False) -> ParsedDelta:
        """The delta for the whole text so far (`finished`: it is the final text; `truncated`:
        cut by its token budget)."""
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
        d = self._tools.feed(content, finished, truncated)
        out.content = d.content
        out.tool_calls = [tc.to_dict() for tc in d.tool_calls
                          if self.plan.parallel or tc.index == 0]
        return out


def finish_reason(reason: str | None, tools_called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended normally with calls."""
    return "tool_calls" if tools_called and reason == "stop" else reason
