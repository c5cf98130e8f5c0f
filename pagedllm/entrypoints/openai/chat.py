"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request with
`n` samples.

The conversation is rendered with the model's template (or `--chat-template`) and tokenized
without adding special tokens again (the template has them). A template sent with the request
(`chat_template`, or `chat_template_kwargs.chat_template`) is refused unless the server runs with
`--trust-request-chat-template` (vLLM's rule: a template is code the front end runs); a trusted
one is stopped past `--chat-template-render-timeout` seconds (`RequestTemplates`). A rendered
prompt longer than the context can hold in characters is refused before it is tokenized.
`max_completion_tokens` (or the older `max_tokens`) defaults to what is left of the context.
A stream starts with one chunk per choice carrying `{"role": "assistant", "content": ""}`.
Image parts (`image_url`, docs/multimodal.md) go to a model that takes images: the images load
on the media threads while the template renders in the tokenizer thread, and the engine gets
`{"prompt": text, "multi_modal_data": {"image": [...]}}` (its processor expands the placeholders).
`tools` / `tool_choice` and the server's reasoning parser shape the message (tool_calling.py):
`tool_calls`, `reasoning_content`, and `finish_reason: "tool_calls"`, in deltas too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.request_stream import RequestStream
from pagedllm.engine.input_processing import check_prompt_chars
from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error, sse_error
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.protocol_base import now_seconds
from pagedllm.entrypoints.openai.request_fields import (
    FieldPlan,
    fit_default_max_tokens,
    log_request,
    make_usage,
    plan_fields,
    prompt_logprobs_json,
    resolve_logprob_fields,
    select_best,
    truncate_prompt,
)
from pagedllm.entrypoints.openai.serving import ServingContext
from pagedllm.entrypoints.openai.streaming import DONE, SSE_HEADERS, ChoiceStream, sse
from pagedllm.entrypoints.openai.tool_calling import ToolPlan, finish_reason, plan_tools
from pagedllm.multimodal.chat_parts import ChatInputs, multimodal_prompt
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import TemplateTimeoutError, max_chars_per_token, render_time_limit

ROLE = "assistant"
DEFAULT_RENDER_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RequestTemplates:
    """What a request may do with a chat template of its own (chat and /tokenize).

    `trusted` (--trust-request-chat-template): without it a request's template is a 400, as
    in vLLM: rendering a template runs code in the front end (a loop of 10^10 steps held every
    later request). A trusted one renders under `render_time_limit` and is stopped past
    `render_timeout_s` (--chat-template-render-timeout) with a 400."""

    trusted: bool = False
    render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S

    def resolve(self, chat_template: str | None,
                template_kwargs: dict[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
        """(the request's own template or None, the other template kwargs)."""
        kwargs = dict(template_kwargs or {})
        from_kwargs = kwargs.pop("chat_template", None)
        template = chat_template if chat_template is not None else from_kwargs
        if template is not None and not self.trusted:
            field = ("chat_template" if chat_template is not None
                     else "chat_template_kwargs.chat_template")
            raise OpenAIError(
                f"`{field}`: a chat template sent with the request is refused; this server "
                "renders its own chat template unless it runs with "
                "--trust-request-chat-template.", 400, param=field)
        return template, kwargs

    def render(self, ctx: ServingContext, conversation: list[dict[str, Any]],
               template: str | None, kwargs: dict[str, Any], request: Any, with_tools: bool = True) -> str:
        """The prompt text (in the tokenizer thread); `request`: a chat or tokenize request;
        `with_tools` False: the tools are not given to the template (generic mode describes
        them in a system message of its own)."""
        def run() -> str:
            return ctx.render_chat(conversation, template, request.add_generation_prompt,
                                   request.continue_final_message, kwargs,
                                   tools=request.template_tools() if with_tools else None)

        if template is None:  # the server's own template: trusted, rendered as is
            return run()
        try:
            with render_time_limit(self.render_timeout_s):
                return run()
        except TemplateTimeoutError as exc:
            raise OpenAIError(f"{exc} (--chat-template-render-timeout)", 400,
                              param="chat_template") from None


@dataclass
class PreparedChat:
    """A chat request made ready for the engine (ChatServer.prepare)."""

    prompt_text: str
    prompt: dict[str, Any]  # the engine's prompt: text, token ids, images, cache_salt
    prompt_len: int
    params: SamplingParams
    plan: ToolPlan
    fields: FieldPlan
    lora: Any


def _token_text(token_id: int) -> str:
    return f"token_id:{token_id}"


class ChatServer:
    def __init__(self, ctx: ServingContext, templates: RequestTemplates | None = None) -> None:
        self.ctx = ctx
        self.templates = templates or RequestTemplates()

    async def prepare(self, request: ChatCompletionRequest, raw_request: Request) -> PreparedChat:
        """Everything before the engine request, shared with /v1/responses (one path under two
        protocols): the model, the template, the messages and their images, the sampling
        parameters, the tool plan, vLLM's request fields, the rendered prompt. Each refusal is
        an OpenAIError (or a ValueError: a 400) naming its field."""
        ctx = self.ctx
        lora = ctx.check_model(request.model)
        template = self.templates.resolve(request.chat_template, request.chat_template_kwargs)
        # template messages and image references; ValueError (refused parts, too many
        # images) -> 400 before anything is fetched
        inputs = request.chat_inputs(ctx.takes_images, ctx.limit_mm_per_prompt, ctx.model_name)
        if inputs.images and request.truncate_prompt_tokens is not None:
            raise OpenAIError("truncate_prompt_tokens is not supported with images: a cut could "
                              "split an image's tokens.", 400, param="truncate_prompt_tokens")
        resolve_logprob_fields(ctx, request)  # -1 and --max-logprobs, before SamplingParams
        params = request.to_sampling_params(ctx.generation_defaults)
        params.verify_token_ids(ctx.vocab_size)
        # the tool format: the server's template's, or that of a (trusted) template of the request's own
        tool_config = ctx.tool_config if template[0] is None else ctx.tool_config.for_template(template[0], log=False)
        plan = plan_tools(request, tool_config)  # 400 for what the server cannot honour
        params = plan.apply(params)  # constrained calls: their schema as structured output
        inputs.messages = plan.conversation(inputs.messages)  # generic mode: tools in a system message
        # vLLM's request fields (request_fields.py): id, priority, best_of, logprob limits
        fields = plan_fields(ctx, request, raw_request, params)
        params = fields.params
        if inputs.images:
            prompt_text, prompt = await self._render_with_images(request, inputs, template, plan)
        else:
            prompt_text, prompt_ids = await ctx.run_tokenizer(self._render, request,
                                                              inputs.messages, template, plan)
            prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        plan.for_prompt(prompt_text)  # does the prompt open the reasoning?
        fit_default_max_tokens(ctx, params, len(prompt["prompt_token_ids"]))
        prompt["cache_salt"] = request.cache_salt
        return PreparedChat(prompt_text, prompt, len(prompt["prompt_token_ids"]), params, plan,
                            fields, lora)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        ctx = self.ctx
        prep = await self.prepare(request, raw_request)
        fields, params, plan, prompt_text = prep.fields, prep.params, prep.plan, prep.prompt_text
        request_id = f"chatcmpl-{fields.request_id}"
        created = now_seconds()
        engine = ctx.async_engine
        log_request(ctx, request_id, prompt_text, params)
        stream = await engine.add_request(
            request_id, prep.prompt, params, priority=request.priority, lora_request=prep.lora,
        )
        if request.stream:
            body = self._stream(request, raw_request, request_id, created, stream, plan,
                                prompt_len=prep.prompt_len)
            return StreamingResponse(
                body, media_type="text/event-stream", headers={**SSE_HEADERS, **fields.headers},
                background=BackgroundTask(engine.abort_unfinished, [stream]),
            )
        final = await engine.final_output(stream)
        final = select_best(fields, final)  # best_of: the n most likely samples
        return JSONResponse(
            self._response(request, request_id, created, final, plan).model_dump(),
            headers=fields.headers)

    async def _render_with_images(self, request: ChatCompletionRequest, inputs: ChatInputs,
                                  template: tuple[str | None, dict[str, Any]], plan: ToolPlan | None = None,
                                  ) -> tuple[str, dict[str, Any]]:
        """(prompt text, the engine's prompt dict) of a conversation with images: rendered in
        the tokenizer thread while the images load on the media threads (ServingContext.
        load_images); text, not token ids: the engine's processor expands the placeholders."""
        ctx = self.ctx
        text, images = await asyncio.gather(
            ctx.run_tokenizer(self._render_text, request, inputs.messages, template, plan),
            ctx.load_images(inputs.images), return_exceptions=True)
        for result in (text, images):
            if isinstance(result, BaseException):
                raise result
        # The model's processor (image resizing, placeholder expansion) off the event loop too.
        processed = await ctx.run_tokenizer(ctx.async_engine.inputs.process_prompt, multimodal_prompt(text, images))
        _, ids, features = processed
        return text, {"prompt": text, "prompt_token_ids": ids, "mm_features": features or []}

    def _render_text(self, request: ChatCompletionRequest, conversation,
                     template: tuple[str | None, dict[str, Any]] | None = None,
                     plan: ToolPlan | None = None) -> str:
        """The rendered prompt (tokenizer thread); `template`: `RequestTemplates.resolve`'s
        answer. A text too long to ever fit is refused before it is tokenized."""
        if template is None:
            template = self.templates.resolve(request.chat_template, request.chat_template_kwargs)
        text = self.templates.render(self.ctx, conversation, *template, request,
                                     with_tools=plan is None or plan.generic_tools is None)
        if request.truncate_prompt_tokens is None:  # a cut prompt may be any length
            check_prompt_chars(text, self.ctx.max_model_len,
                               max_chars_per_token(self.ctx.tokenizer))
        return text

    def _render(self, request: ChatCompletionRequest, conversation,
                template: tuple[str | None, dict[str, Any]] | None = None, plan: ToolPlan | None = None,
                ) -> tuple[str, list[int]]:
        """(prompt text, token ids); `template`: `RequestTemplates.resolve`'s answer."""
        text = self._render_text(request, conversation, template, plan)
        # add_special_tokens (vLLM's, default false: the template has them); truncation keeps
        # the last truncate_prompt_tokens tokens
        ids = self.ctx.encode(text, add_special_tokens=request.add_special_tokens)
        kept = truncate_prompt(ids, request.truncate_prompt_tokens)
        if len(kept) < len(ids):
            text = self.ctx.decode(kept)
        return text, kept

    @staticmethod
    def _echo_text(request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content when it is the assistant's own."""
        if not request.echo or not request.messages or request.messages[-1].role != ROLE:
            return ""
        return request.messages[-1].text()

    def _response(
        self, request: ChatCompletionRequest, request_id: str, created: int, out: RequestOutput,
        plan: ToolPlan,
    ) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        for c in out.outputs:
            n_ids = len(c.token_ids)
            completion_tokens += n_ids
            logprobs = None
            if request.logprobs and c.logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs[:n_ids],
                                         request.top_logprobs or 0, _token_text)
            parsed = plan.choice_parser().full(c.text, truncated=c.finish_reason == "length")
            echo = self._echo_text(request)
            if echo and (parsed.content is not None or not parsed.tool_calls):
                parsed.content = echo + (parsed.content or "")
            message = ChatMessage(role=ROLE, content=parsed.content,
                                  reasoning_content=parsed.reasoning_content,
                                  tool_calls=parsed.tool_calls or None)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs,
                finish_reason=finish_reason(c.finish_reason, bool(parsed.tool_calls)),
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if request.return_token_ids else None,
            ))
        prompt_tokens = len(out.prompt_token_ids)
        usage = make_usage(self.ctx, prompt_tokens, completion_tokens, out.num_cached_tokens)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.ctx.served_name(request.model), choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_json(out) if request.prompt_logprobs is not None
            else None,
            prompt_token_ids=list(out.prompt_token_ids) if request.return_token_ids else None)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        raw_request: Request,
        request_id: str,
        created: int,
        stream: RequestStream,
        plan: ToolPlan,
        prompt_len: int = 0,
    ) -> AsyncIterator[str]:
        engine = self.ctx.async_engine
        model = self.ctx.served_name(request.model)
        include_usage = request.include_usage
        choices = [ChoiceStream() for _ in range(request.n)]
        # tool calls / reasoning: each choice's text so far, read by its parser
        parsers = [plan.choice_parser() for _ in range(request.n)]
        texts = [""] * request.n

        latest: list[RequestOutput | None] = [None]  # for continuous_usage_stats

        def chunk(choice: ChatCompletionStreamChoice, **extra) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=[choice], **extra)
            if request.continuous_usage:  # before any output: the prompt alone
                o = latest[0]
                body.usage = make_usage(
                    self.ctx, prompt_len if o is None else len(o.prompt_token_ids),
                    sum(cs.sent_tokens for cs in choices),
                    None if o is None else o.num_cached_tokens)
            return sse(body, include_usage)

        echo = self._echo_text(request)
        try:
            for i in range(request.n):
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role=ROLE, content=""), logprobs=None,
                    finish_reason=None))
                if echo:  # vLLM's chat echo: the assistant's last content comes first
                    yield chunk(ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(content=echo), logprobs=None))
            final: RequestOutput | None = None
            sent_prompt_ids = False
            async for out in engine.stream_outputs(stream):
                if await raw_request.is_disconnected():
                    return
                final = out
                latest[0] = out
                for c in out.outputs:
                    cs = choices[c.index]
                    if cs.finished:
                        continue
                    text, ids, lps = cs.delta(c)
                    logprobs = None
                    if request.logprobs and lps:
                        logprobs = chat_logprobs(ids, lps, request.top_logprobs or 0, _token_text)
                    delta = DeltaMessage(content=text)
                    parser = parsers[c.index]
                    if parser.active:
                        texts[c.index] += text
                        parsed = parser.delta(texts[c.index], c.finish_reason is not None,
                                              truncated=c.finish_reason == "length")
                        delta = DeltaMessage(content=parsed.content or None,
                                             reasoning_content=parsed.reasoning_content or None,
                                             tool_calls=parsed.tool_calls or None)
                        if not parsed and c.finish_reason is None and logprobs is None:
                            continue
                    elif not text and c.finish_reason is None and logprobs is None:
                        continue
                    extra = {}
                    if request.return_token_ids and not sent_prompt_ids:
                        extra["prompt_token_ids"] = list(out.prompt_token_ids)
                        sent_prompt_ids = True
                    yield chunk(ChatCompletionStreamChoice(
                        index=c.index, delta=delta, logprobs=logprobs,
                        finish_reason=finish_reason(c.finish_reason, parser.tools_called),
                        stop_reason=c.stop_reason,
                        token_ids=list(ids) if request.return_token_ids else None), **extra)
            if include_usage and final is not None:
                prompt_tokens = len(final.prompt_token_ids)
                completion_tokens = sum(cs.sent_tokens for cs in choices)
                usage = make_usage(self.ctx, prompt_tokens, completion_tokens,
                                   final.num_cached_tokens)
                yield sse(ChatCompletionStreamResponse(id=request_id, created=created,
                                                       model=model, choices=[], usage=usage),
                          include_usage=True)
            yield DONE
        except Exception as exc:  # the headers are sent: report in the stream
            yield sse_error(as_openai_error(exc))
            yield DONE
        finally:
            engine.abort_unfinished([stream])
