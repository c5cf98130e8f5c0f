"""The /v1/completions request and response bodies (OpenAI's, with vLLM's extra fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol_base import (
    OpenAIBaseModel,
    ResponseModel,
    UsageInfo,
    now_seconds,
    random_uuid,
)
from pagedllm.entrypoints.openai.sampling_request import SamplingRequest
from pagedllm.sampling_params import SamplingParams


class CompletionRequest(SamplingRequest):
    # https://platform.openai.com/docs/api-reference/completions/create
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=-1)  # -1: the whole vocabulary (vLLM)
    max_tokens: int | None = 16
    suffix: str | None = None
    # vLLM extra
    add_special_tokens: bool = True

    @property
    def echo_without_generation(self) -> bool:
        """echo with max_tokens=0: return the prompt (and its logprobs) only."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        # echo + logprobs: the prompt's tokens get logprobs too.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        max_tokens = self.max_tokens
        cap = (defaults or {}).get("max_tokens")
        if cap is not None:  # generation_config's max_new_tokens (vLLM takes the smallest)
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        return SamplingParams(
            **self._sampling_kwargs(defaults),
            max_tokens=1 if self.echo_without_generation else max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extras: prompt_logprobs (asked for), prompt_token_ids / token_ids (return_token_ids)
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the choice's first chunk
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new token ids


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
