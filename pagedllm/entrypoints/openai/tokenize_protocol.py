"""vLLM's /tokenize and /detokenize bodies; a chat-style /tokenize takes chat messages and
tools, so that it counts what /v1/chat/completions would send the model."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionToolParam, ChatMessageParam
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either `prompt` (completion style) or `messages` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None  # shown to the template, as in chat
    return_token_strs: bool = False

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Give exactly one of `prompt` or `messages`.")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
