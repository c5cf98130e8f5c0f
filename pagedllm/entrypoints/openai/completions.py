"""POST /v1/completions: prompts (string, strings, token ids, lists of token ids) to text.

Each prompt is one engine request (`{id}-{i}`) with `n` samples; choice `i * n + k` is sample
`k` of prompt `i`, as in vLLM. `echo` prepends the prompt (its text and, with `logprobs`, its
token logprobs); `echo` with `max_tokens=0` returns the prompt alone (one token is generated
and dropped). Usage counts each prompt once and every returned completion token.
vLLM's request fields (request_id, priority, best_of, return_token_ids, prompt_logprobs,
truncate_prompt_tokens, ...) are resolved in request_fields.py (docs/server_fields.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.request_stream import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error, sse_error
from pagedllm.entrypoints.openai.logprobs import completion_logprobs
from pagedllm.entrypoints.openai.completion_protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from pagedllm.entrypoints.openai.protocol_base import UsageInfo, now_seconds
from pagedllm.entrypoints.openai.request_fields import (
    FieldPlan,
    log_request,
    make_usage,
    plan_fields,
    prompt_logprobs_json,
    resolve_logprob_fields,
    select_best,
    truncate_prompt,
)
from pagedllm.entrypoints.openai.serving import ServingContext
from pagedllm.entrypoints.openai.streaming import (
    DONE,
    SSE_HEADERS,
    ChoiceStream,
    merge_async_iterators,
    sse,
)
from pagedllm.outputs import CompletionOutput, RequestOutput


@dataclass
class _Prompt:
    text: str | None  # the prompt's text (decoded from the ids when given as ids and echoed)
    token_ids: list[int]
    first_token_text: str = ""  # for echo + logprobs: position 0 has no engine logprob entry


class CompletionServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        if request.suffix:
            raise OpenAIError("suffix is not supported by this server.", 400, param="suffix")
        resolve_logprob_fields(ctx, request)  # -1 and --max-logprobs, before SamplingParams
        params = request.to_sampling_params(ctx.generation_defaults)  # ValueError -> 400
        params.verify_token_ids(ctx.vocab_size)
        plan = plan_fields(ctx, request, raw_request, params)
        params = plan.params
        prompts = await ctx.run_tokenizer(self._prepare_prompts, request)
        request_id = f"cmpl-{plan.request_id}"
        created = now_seconds()
        engine = ctx.async_engine
        for i, p in enumerate(prompts):
            log_request(ctx, f"{request_id}-{i}", p.text if p.text is not None else p.token_ids,
                        params)
        streams = await engine.add_requests(
            [(f"{request_id}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids,
                                    "cache_salt": request.cache_salt})
             for i, p in enumerate(prompts)],
            params, priority=request.priority, lora_request=lora,
        )
        if request.stream:
            body = self._stream(request, raw_request, request_id, created, prompts, streams)
            return StreamingResponse(
                body, media_type="text/event-stream", headers={**SSE_HEADERS, **plan.headers},
                background=BackgroundTask(engine.abort_unfinished, streams),
            )
        try:
            finals: list[RequestOutput | None] = [None] * len(streams)
            iterators = [engine.stream_outputs(s) for s in streams]
            async for i, out in merge_async_iterators(*iterators):
                finals[i] = out
        finally:
            engine.abort_unfinished(streams)
        finals = [select_best(plan, out) for out in finals]
        response = self._response(request, request_id, created, prompts, finals, plan)
        return JSONResponse(response.model_dump(), headers=plan.headers)

    # ---- prompts (tokenizer thread) -------------------------------------------------------

    def _prepare_prompts(self, request: CompletionRequest) -> list[_Prompt]:
        ctx = self.ctx
        raw = request.prompt
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif not raw:
            raise OpenAIError("prompt must not be empty.", 400, param="prompt")
        elif isinstance(raw[0], int):
            items = [list(raw)]
        else:
            items = list(raw)
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = ctx.encode(item, add_special_tokens=request.add_special_tokens)
                text = item
                kept = truncate_prompt(ids, request.truncate_prompt_tokens)
                if len(kept) < len(ids):  # the model sees (and echo returns) the kept part
                    ids, text = kept, ctx.decode(kept)
            else:
                ids = truncate_prompt(list(item), request.truncate_prompt_tokens)
                ctx.check_token_ids(ids)
                text = ctx.decode(ids) if request.echo else None
            first = ctx.decode(ids[:1]) if request.echo and ids else ""
            prompts.append(_Prompt(text, ids, first))
        return prompts

    # ---- one choice -----------------------------------------------------------------------

    @staticmethod
    def _token_text(prompt: _Prompt):
        first = prompt.token_ids[0] if prompt.token_ids else None
        return lambda t: prompt.first_token_text if t == first else f"token_id:{t}"

    def _choice_parts(
        self, request: CompletionRequest, prompt: _Prompt, out: RequestOutput, c: CompletionOutput
    ) -> tuple[str, list[int], list | None]:
        """(text, token ids, logprobs) of a finished choice, the prompt prepended for echo."""
        n_ids = len(c.token_ids)
        lps = list(c.logprobs[:n_ids]) if c.logprobs is not None else None
        if request.echo_without_generation:
            text, ids, lps = "", [], []
        else:
            text, ids = c.text, list(c.token_ids)
        if request.echo:
            text = (prompt.text or "") + text
            ids = list(prompt.token_ids) + ids
            if request.logprobs is not None:
                prompt_lps = list(out.prompt_logprobs or [None])
                lps = prompt_lps + (lps or [])
        return text, ids, lps

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: list[_Prompt],
        finals: list[RequestOutput | None],
        plan: FieldPlan,
    ) -> CompletionResponse:
        choices = []
        usage = UsageInfo()
        n = request.n
        cached = 0
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            assert out is not None and out.finished
            usage.prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens or 0
            prompt_lps = (prompt_logprobs_json(out) if request.prompt_logprobs is not None
                          else None)
            for c in out.outputs:
                text, ids, lps = self._choice_parts(request, prompt, out, c)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(ids, lps or [], self._token_text(prompt))
                finish, stop_reason = c.finish_reason, c.stop_reason
                if request.echo_without_generation:
                    finish, stop_reason = "length", None
                else:
                    usage.completion_tokens += len(c.token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * n + c.index, text=text, logprobs=logprobs,
                    finish_reason=finish, stop_reason=stop_reason, prompt_logprobs=prompt_lps,
                    prompt_token_ids=list(out.prompt_token_ids) if request.return_token_ids
                    else None,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                ))
        choices.sort(key=lambda ch: ch.index)
        usage = make_usage(self.ctx, usage.prompt_tokens, usage.completion_tokens, cached)
        return CompletionResponse(id=request_id, created=created, model=self.ctx.served_name(request.model),
                                  choices=choices, usage=usage)

    # ---- streaming ------------------------------------------------------------------------

    async def _stream(
        self,
        request: CompletionRequest,
        raw_request: Request,
        request_id: str,
        created: int,
        prompts: list[_Prompt],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        engine = self.ctx.async_engine
        model = self.ctx.served_name(request.model)
        n = request.n
        choice_state = [[ChoiceStream() for _ in range(n)] for _ in prompts]
        echoed = [[False] * n for _ in prompts]
        usage = UsageInfo()
        cached = 0
        # continuous_usage_stats: the usage so far on every chunk
        prompt_tokens_seen: dict[int, int] = {}
        generated: dict[tuple[int, int], int] = {}
        try:
            iterators = [engine.stream_outputs(s) for s in streams]
            async for i, out in merge_async_iterators(*iterators):
                if await raw_request.is_disconnected():
                    break
                prompt = prompts[i]
                for c in out.outputs:
                    cs = choice_state[i][c.index]
                    if cs.finished:
                        continue
                    chars_before = cs.sent_chars
                    text, ids, lps = cs.delta(c)
                    new_ids = list(ids)
                    first_chunk = not echoed[i][c.index]
                    finish, stop_reason = c.finish_reason, c.stop_reason
                    if request.echo_without_generation:
                        text, ids, lps = "", [], []
                        if finish is not None:
                            finish, stop_reason = "length", None
                    offset = chars_before
                    if request.echo:
                        offset += len(prompt.text or "")
                        if first_chunk:
                            offset = 0
                            text = (prompt.text or "") + text
                            ids = list(prompt.token_ids) + ids
                            if request.logprobs is not None:
                                lps = list(out.prompt_logprobs or [None]) + (lps or [])
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = completion_logprobs(ids, lps or [], self._token_text(prompt),
                                                       initial_text_offset=offset)
                    if not text and finish is None and not (logprobs and logprobs.tokens):
                        continue
                    echoed[i][c.index] = True
                    rti = request.return_token_ids
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionStreamChoice(
                            index=i * n + c.index, text=text, logprobs=logprobs,
                            finish_reason=finish, stop_reason=stop_reason,
                            prompt_token_ids=list(prompt.token_ids) if rti and first_chunk
                            else None,
                            token_ids=new_ids if rti else None,
                        )],
                    )
                    if request.continuous_usage:
                        prompt_tokens_seen[i] = len(out.prompt_token_ids)
                        if not request.echo_without_generation:
                            generated[(i, c.index)] = cs.sent_tokens
                        chunk.usage = make_usage(self.ctx, sum(prompt_tokens_seen.values()),
                                                 sum(generated.values()),
                                                 out.num_cached_tokens)
                    yield sse(chunk, request.include_usage)
                if out.finished:
                    usage.prompt_tokens += len(out.prompt_token_ids)
                    cached += out.num_cached_tokens or 0
                    if not request.echo_without_generation:
                        usage.completion_tokens += sum(cs.sent_tokens for cs in choice_state[i])
            else:
                if request.include_usage:
                    usage = make_usage(self.ctx, usage.prompt_tokens, usage.completion_tokens,
                                       cached)
                    yield sse(CompletionStreamResponse(id=request_id, created=created,
                                                       model=model, choices=[], usage=usage),
                              include_usage=True)
                yield DONE
        except Exception as exc:  # the headers are sent: report in the stream
            yield sse_error(as_openai_error(exc))
            yield DONE
        finally:
            engine.abort_unfinished(streams)
