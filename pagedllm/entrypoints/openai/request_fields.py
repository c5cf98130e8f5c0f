"""vLLM's per-request fields that both /v1/completions and /v1/chat/completions honour, in one
place: the request id (`request_id` or the `X-Request-Id` header), `priority`, refused and
ignored fields, `logprobs=-1` / `prompt_logprobs` against `--max-logprobs`, the model's
generation_config defaults, `truncate_prompt_tokens`, `best_of`, `return_token_ids`, prompt
logprobs in the body, and the usage (with `prompt_tokens_details.cached_tokens` under
`--enable-prompt-tokens-details`, on every chunk with `continuous_usage_stats`).

The field-by-field table is docs/server_fields.md.
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pagedllm.core.scheduler_config import check_priority
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol_base import PromptTokenUsageInfo, UsageInfo, random_uuid
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.sampling_request import SamplingRequest
    from pagedllm.entrypoints.openai.serving import ServingContext

logger = logging.getLogger("pagedllm.server")

REQUEST_ID_HEADER = "X-Request-Id"
IGNORED_FIELDS_HEADER = "X-Pagedllm-Ignored-Fields"


@dataclass
class FieldPlan:
    """What the serving code needs of the fields above, decided before the engine sees it."""

    request_id: str  # the client's id (or a fresh one); the response id derives from it
    params: SamplingParams  # what the engine runs (n = best_of when best_of > n)
    n: int  # choices returned
    best_of: int | None = None  # > n: sample this many, return the n best
    strip_logprobs: bool = False  # best_of asked for sample logprobs the client did not
    headers: dict[str, str] = field(default_factory=dict)


def header_value(text: str) -> str:
    """`text` as a legal HTTP header value: printable ASCII stays, anything else (control
    characters, CR/LF, spaces, non-ASCII) is percent-encoded. A request id or an unknown field
    name is the client's text: put raw in a header, h11 refused it and the connection dropped
    with no answer (or a header injection, were it accepted)."""
    return urllib.parse.quote(text, safe=_HEADER_SAFE)


_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def resolve_logprob_fields(ctx: "ServingContext", request: "SamplingRequest") -> None:
    """Before the SamplingParams are built: `-1` (vLLM's "the whole vocabulary") becomes the
    vocabulary size, and a count over --max-logprobs is a 400 naming the field."""
    inputs = ctx.async_engine.inputs
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(request, name, None)
        if isinstance(value, bool) or not isinstance(value, int):
            continue  # chat's logprobs is a flag
        try:
            setattr(request, name, inputs.resolve_num_logprobs(value, name))
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param=name) from exc


def plan_fields(ctx: "ServingContext", request: "SamplingRequest", raw_request: Request,
                params: SamplingParams) -> FieldPlan:
    """Check and resolve the shared fields; an OpenAIError (400) names the offending one."""
    refused = request.refused_field()
    if refused is not None:
        name, why = refused
        raise OpenAIError(f"The request field `{name}` is not supported by this server: {why}.",
                          400, param=name)
    try:
        check_priority(request.priority, ctx.async_engine.inputs.scheduling_policy)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="priority") from exc
    header_id = raw_request.headers.get(REQUEST_ID_HEADER)
    request_id = request.request_id or header_id or random_uuid()
    headers = {REQUEST_ID_HEADER: header_value(request_id)}
    ignored = request.ignored_fields()
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s "
                       "(request %s)", ignored, request_id)
        headers[IGNORED_FIELDS_HEADER] = ",".join(header_value(name) for name in ignored)
    inputs = ctx.async_engine.inputs
    # chat names the count top_logprobs; -1 = the whole vocabulary (vLLM)
    lp_name = "top_logprobs" if hasattr(request, "top_logprobs") else "logprobs"
    for attr, name in (("logprobs", lp_name), ("prompt_logprobs", "prompt_logprobs")):
        try:
            setattr(params, attr, inputs.resolve_num_logprobs(getattr(params, attr), name))
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, param=name) from exc
    plan = FieldPlan(request_id=request_id, params=params, n=params.n, headers=headers)
    best_of = request.best_of
    if best_of is not None and best_of > params.n:
        if request.stream:
            raise OpenAIError("best_of > n is not supported with stream=true (the best samples "
                              "are known only at the end).", 400, param="best_of")
        if params.use_beam_search:
            raise OpenAIError("best_of does not apply to beam search (its width is n).", 400,
                              param="best_of")
        plan.best_of = best_of
        plan.strip_logprobs = params.logprobs is None
        plan.params = dataclasses.replace(
            params, n=best_of, logprobs=0 if params.logprobs is None else params.logprobs)
    return plan


def log_request(ctx: "ServingContext", request_id: str, prompt: Any,
                params: SamplingParams) -> None:
    """--enable-log-requests: the id, the prompt (cut at --max-log-len) and the parameters."""
    if not ctx.options.log_requests:
        return
    limit = ctx.options.max_log_len
    if limit is not None:
        prompt = prompt[:limit]
    logger.info("Received request %s: prompt: %r, params: %s", request_id, prompt, params)


def truncate_prompt(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (left truncation)."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:]


def fit_default_max_tokens(ctx: "ServingContext", params: SamplingParams,
                           prompt_len: int) -> None:
    """Unset max_tokens under a generation_config max_new_tokens: the smaller of it and what is
    left of the context (as vLLM's get_max_tokens)."""
    cap = ctx.generation_defaults.get("max_tokens")
    if params.max_tokens is None and cap is not None:
        params.max_tokens = max(1, min(cap, ctx.max_model_len - prompt_len))


def select_best(plan: FieldPlan, out: RequestOutput) -> RequestOutput:
    """best_of: the n samples of highest cumulative logprob, re-indexed 0..n-1."""
    if plan.best_of is None:
        return out
    ranked = sorted(out.outputs, key=lambda c: (c.cumulative_logprob is None,
                                                -(c.cumulative_logprob or 0.0), c.index))
    chosen = []
    for i, c in enumerate(ranked[: plan.n]):
        c = dataclasses.replace(c, index=i)
        if plan.strip_logprobs:
            c = dataclasses.replace(c, logprobs=None, cumulative_logprob=None)
        chosen.append(c)
    return dataclasses.replace(out, outputs=chosen)


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's body shape: per prompt position None or {token id: {logprob, rank,
    decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            str(tid): {"logprob": lp.logprob if lp.logprob > float("-inf") else -9999.0,
                       "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


def make_usage(ctx: "ServingContext", prompt_tokens: int, completion_tokens: int,
               cached_tokens: int | None) -> UsageInfo:
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    if ctx.options.enable_prompt_tokens_details:
        usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens or 0)
    return usage
