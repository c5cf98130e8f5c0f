"""The request fields /v1/completions and /v1/chat/completions share, and how they become
`SamplingParams`.

Unknown fields are accepted, but not silently: the server logs them ("The following fields were
present in the request but ignored: ...", as vLLM) and names them in the
`X-Pagedllm-Ignored-Fields` response header. A field of vLLM's request models that pagedllm does
not implement is refused by name (400, `REFUSED_FIELDS`), never accepted and ignored
(docs/server_fields.md). The structured-output fields (OpenAI's `response_format`, vLLM's
`structured_outputs` and older `guided_*`) meet here, so that a request gives at most one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, StreamOptions
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.structured_outputs_params import StructuredOutputsParams

# torch.Generator seeds are 64-bit; vLLM bounds them the same way.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1

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



def first_refused(extra: dict[str, Any] | None, refused: dict[str, str],
                  noop: dict[str, tuple]) -> tuple[str, str] | None:
    """(field, why) of the first field in `extra` (a body's unknown fields) that `refused`
    names, unless set to None or to one of its no-op values; None when there is none."""
    for name, value in (extra or {}).items():
        if name in refused and value is not None and value not in noop.get(name, ()):
            return name, refused[name]
    return None

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


class SamplingRequest(OpenAIBaseModel):
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
        return first_refused(self.model_extra, REFUSED_FIELDS, _NOOP_VALUES)

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
