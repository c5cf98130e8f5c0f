"""The /v1/chat/completions bodies: messages (as chat templates read them), tools, and the
response and stream chunks (OpenAI's shapes, with vLLM's extra fields)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from pagedllm.entrypoints.openai.protocol_base import (
    OpenAIBaseModel,
    ResponseModel,
    UsageInfo,
    now_seconds,
    random_uuid,
)
from pagedllm.entrypoints.openai.sampling_request import SamplingRequest
from pagedllm.multimodal.chat_parts import ChatInputs, parse_content
from pagedllm.multimodal.limits import check_image_count
from pagedllm.sampling_params import SamplingParams


class ImageURL(OpenAIBaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ChatContentPart(OpenAIBaseModel):
    """A content part: `text`, `image_url` (OpenAI's `{"url", "detail"}`), an assistant's
    `refusal`; every other type is refused by name (multimodal/chat_parts.py)."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    refusal: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON string


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"call_{random_uuid()[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


_TEXT: Any = object()  # template_message's default: the message's text


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def template_message(self, content: Any = _TEXT) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention): an assistant's
        `tool_calls` with `function.arguments` parsed to a dict (Qwen2.5, Llama 3.1 and Hermes
        templates render `arguments | tojson`), a tool result's `tool_call_id` kept.
        `content`: the content already in template form (chat_parts.parse_content); default
        `text()`."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text() if content is _TEXT else content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            calls = []
            for i, tc in enumerate(self.tool_calls):
                try:
                    args = json.loads(tc.function.arguments) if tc.function.arguments else {}
                except ValueError:
                    raise ValueError(
                        f"tool_calls[{i}].function.arguments of an assistant message is not "
                        "valid JSON."
                    ) from None
                calls.append({"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg

    def text(self) -> str:
        """The message's text parts joined by newlines; any other part is a 400 (where images
        are taken, `ChatCompletionRequest.chat_inputs` reads the parts)."""
        text, _ = parse_content(self.content, "message", takes_images=False,
                                model_name="this endpoint")
        return text  # a string: takes_images=False


class ChatCompletionRequest(SamplingRequest):
    # https://platform.openai.com/docs/api-reference/chat/create
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=-1)  # -1: the whole vocabulary (vLLM)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (docs/tool_calling.md); tool_choice defaults to "auto" with tools, else "none"
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None  # unset: the server's default for its tool format
    # vLLM's: with --reasoning-parser, false drops reasoning_content from the response
    include_reasoning: bool = True
    # vLLM's: prepend the last message's content to the reply when it is the assistant's
    echo: bool = False
    # vLLM's: add the tokenizer's special tokens (BOS) on top of what the template has
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    @model_validator(mode="after")
    def _check_tool_usage(self):
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        if self.tool_choice != "none" and not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise ValueError(
                    f"Tool name '{name}' in `tool_choice` does not match any of the specified "
                    "`tools`."
                )
        return self

    def conversation(self) -> list[dict[str, Any]]:
        """The messages in template form, text only (image parts are a 400)."""
        return [m.template_message() for m in self.messages]

    def chat_inputs(self, takes_images: bool, limits: dict[str, int] | None = None,
                    model_name: str = "this model") -> ChatInputs:
        """The messages in template form and their images in order (no I/O: nothing is
        fetched); a 400 for refused parts and more images than `limits` allow. A model that
        takes images gets every content as a list (`[{"type": "image"}, {"type": "text", ...}]`)."""
        messages: list[dict[str, Any]] = []
        images = []
        for i, m in enumerate(self.messages):
            content, found = parse_content(m.content, f"messages[{i}]", takes_images,
                                           model_name=model_name)
            messages.append(m.template_message(content))
            images.extend(found)
        check_image_count(len(images), limits)
        return ChatInputs(messages, images)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as apply_chat_template takes them (OpenAI's dicts, as transformers expects)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens  # None: up to the context length
        cap = (defaults or {}).get("max_tokens")
        if cap is not None and max_tokens is not None:  # vLLM takes the smallest
            max_tokens = min(max_tokens, cap)  # (unset: the server fits the cap to the context)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs:
            prompt_logprobs = self.top_logprobs or 0
        return SamplingParams(
            **self._sampling_kwargs(defaults),
            max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # asked for
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # OpenAI's delta shape: [{"index", "id", "type", "function": {"name", "arguments"}}], the
    # first per call with id, type and name, then {"index", "function": {"arguments": ...}}
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new token ids


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk
