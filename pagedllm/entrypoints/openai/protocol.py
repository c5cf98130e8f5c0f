"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra fields.

Requests accept unknown fields, so that clients that send newer OpenAI fields keep working, but
not silently: the server logs them ("The following fields were present in the request but
ignored: ...", as vLLM) and names them in the `X-Pagedllm-Ignored-Fields` response header. A
field of vLLM's request models that pagedllm does not implement is refused by name (400,
`REFUSED_FIELDS`), never accepted and ignored (docs/server_fields.md). Responses follow OpenAI's
shapes field for field; `stop_reason` is vLLM's addition (the stop string or token id that
ended a choice).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, field_validator, model_serializer,
                      model_validator)

from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# torch.Generator seeds are 64-bit; vLLM bounds them the same way.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
# Most top log-probabilities a request may ask for, per token (vLLM's default max_logprobs;
# the server's --max-logprobs is what is enforced, in the serving layer).
MAX_LOGPROBS = 20

# vLLM request fields pagedllm does not implement: a request that sets one (to anything but
# null / its no-op value) is a 400 naming it. field -> why / what to do instead.
REFUSED_FIELDS: dict[str, str] = {
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "logits_processors": "custom logits processors are not supported",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not supported",
    "vllm_xargs": "custom extension arguments are not supported",
    "mm_processor_kwargs": "this server serves text-only models",
    "media_io_kwargs": "this server serves text-only models",
    "documents": "RAG documents are not passed to the chat template; put them in a message",
    "return_tokens_as_token_ids": "logprob tokens are always text; use return_token_ids",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "functions": "the deprecated `functions` field is not supported; use `tools`",
    "function_call": "the deprecated `function_call` field is not supported; use `tool_choice`",
    "guided_whitespace_pattern": "a custom whitespace pattern is not supported; use "
    "structured_outputs.disable_any_whitespace",
    "guided_decoding_backend": "the only structured-output backend is xgrammar",
}
# Their no-op values (accepted: they ask for nothing pagedllm lacks).
_NOOP_VALUES: dict[str, tuple] = {"modalities": (["text"],), "return_tokens_as_token_ids": (False,),
                                  "guided_decoding_backend": ("xgrammar", "auto")}


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


class _ResponseModel(OpenAIBaseModel):
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


class UsageInfo(_ResponseModel):
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


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" with `json_schema: {"name", "schema", "strict", "description"}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def to_structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        spec = self.json_schema or {}
        schema = spec.get("schema")
        if schema is None:
            raise ValueError(
                "response_format.json_schema.schema is required when response_format.type "
                "is 'json_schema'."
            )
        # strict true or not, the schema is enforced (vLLM does the same); xgrammar's
        # strict mode also forbids properties the schema does not name.
        return StructuredOutputsParams(json=schema)


_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: salts the prefix cache so that only requests with the same salt share blocks
    # (tenants apart; a salt should be secret and unguessable, e.g. 256 random bits)
    cache_salt: str | None = None
    # Structured outputs (docs/structured_outputs.md): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields (one of them per request); and
    # the token masks allowed_token_ids / bad_words.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    # vLLM's: lower = earlier under --scheduling-policy priority (non-zero under fcfs: 400)
    priority: int = 0
    # vLLM's: the request's id (also the X-Request-Id header); the response id derives from it
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: the response carries prompt_token_ids and each choice's token_ids
    return_token_ids: bool = False
    # vLLM's: keep only the last k prompt tokens (left truncation)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # vLLM's: logprobs of every prompt token (top-k per position; -1: the whole vocabulary)
    prompt_logprobs: int | None = Field(default=None, ge=-1)

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) of the first field set that pagedllm does not implement."""
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_FIELDS and value is not None \
                    and value not in _NOOP_VALUES.get(name, ()):
                return name, REFUSED_FIELDS[name]
        return None

    def ignored_fields(self) -> list[str]:
        """Fields of the body that no part of pagedllm reads (logged, and sent back in the
        X-Pagedllm-Ignored-Fields header)."""
        return sorted(k for k in (self.model_extra or {}) if k not in REFUSED_FIELDS)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_cache_salt(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one output constraint; two given at once is a ValueError (a 400)."""
        given: dict[str, StructuredOutputsParams] = {}
        if self.response_format is not None:
            so = self.response_format.to_structured_outputs()
            if so is not None:
                given["response_format"] = so
        if self.structured_outputs is not None:
            given["structured_outputs"] = StructuredOutputsParams.from_dict(self.structured_outputs)
        for name, kind in _GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                given[name] = StructuredOutputsParams(**{kind: value})
        if len(given) > 1:
            raise ValueError(
                f"Only one kind of structured output may be given per request, got {sorted(given)}."
            )
        return next(iter(given.values()), None)

    def _sampling_kwargs(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """`defaults`: the model's generation_config.json values (--generation-config), used
        for the fields the request leaves unset, then vLLM's built-in defaults."""
        d = defaults or {}

        def pick(value: Any, name: str, builtin: Any) -> Any:
            return value if value is not None else d.get(name, builtin)

        return dict(
            structured_outputs=self.structured_outputs_params(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            # a stream sends what is new; a plain response needs only the end
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


# ----------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
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


class CompletionResponseChoice(_ResponseModel):
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


class CompletionStreamChoice(_ResponseModel):
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


# ------------------------------------------------------------------------------------ chat


class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


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


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention): an assistant's
        `tool_calls` with `function.arguments` parsed to a dict (Qwen2.5, Llama 3.1 and Hermes
        templates render `arguments | tojson`), a tool result's `tool_call_id` kept."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
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
        """The message's text; content parts other than text are a 400."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(
                    f"Content parts of type {part.type!r} are not supported: this model takes "
                    "text only (parts of type 'text')."
                )
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingFields):
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
    parallel_tool_calls: bool | None = True
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
        return [m.template_message() for m in self.messages]

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


class ChatCompletionResponseChoice(_ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_ResponseModel):
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


class ChatCompletionStreamChoice(_ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new token ids


class ChatCompletionStreamResponse(_ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


# ------------------------------------------------------------------------- models, tokens


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/unload_lora_adapter body (the name, or vLLM's lora_int_id)."""

    lora_name: str | None = None
    lora_int_id: int | None = None


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
