"""What every OpenAI request and response body shares: the base model, ids and timestamps,
usage, errors and stream options.

Bodies accept unknown fields (`extra="allow"`), so that clients sending newer OpenAI fields keep
working; the request models decide what to do with them (`sampling_request.py`). Responses
follow OpenAI's shapes field for field, and vLLM's optional extras (token ids, prompt logprobs,
cached-token details) are left out unless the request asked for them (`ResponseModel`).
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, model_serializer

def random_uuid() -> str:
    return uuid.uuid4().hex


def now_seconds() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# vLLM's optional response extras: left out of the body unless the request asked for them
# (return_token_ids, prompt_logprobs, --enable-prompt-tokens-details), so that OpenAI's shapes
# stay exactly OpenAI's by default.
_OPTIONAL_EXTRAS = ("prompt_logprobs", "prompt_token_ids", "token_ids", "prompt_tokens_details")


class ResponseModel(OpenAIBaseModel):
    """A response body that drops the vLLM extras the request did not ask for (None)."""

    @model_serializer(mode="wrap")
    def _drop_unasked_extras(self, handler):
        data = handler(self)
        for key in _OPTIONAL_EXTRAS:
            if key in data and data[key] is None:
                del data[key]
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    # vLLM's: every chunk carries the usage so far (needs include_usage)
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    # --enable-prompt-tokens-details: prompt tokens served by the prefix cache
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------ sampling
