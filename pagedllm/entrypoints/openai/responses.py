"""POST /v1/responses, GET / DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
completion path (docs/responses_api.md).

A request becomes a chat completion request (responses_protocol.py), which runs as chat runs
it: the chat template (ChatServer's rendering), the tool plan (`tools` / `tool_choice`, the
server's tool and reasoning parsers), structured output (`text.format`), one engine request.
Its output becomes `output` items (responses_output.py). A finished response is kept in the
response store (response_store.py) unless `store` is false or the store is off; a
`previous_response_id` replays that response's input and output items before the new input,
so the prompt starts with the earlier turn's tokens and the prefix cache serves them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.request_stream import RequestStream
from pagedllm.entrypoints.openai.chat import ChatServer
from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error
from pagedllm.entrypoints.openai.protocol_base import now_seconds
from pagedllm.entrypoints.openai.request_fields import (
    IGNORED_FIELDS_HEADER,
    fit_default_max_tokens,
    header_value,
    log_request,
    plan_fields,
)
from pagedllm.entrypoints.openai.response_store import ResponseStore, new_response_id, owner_of
from pagedllm.entrypoints.openai.responses_output import (
    StreamBuilder,
    output_items,
    response_object,
    status_of,
    usage,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.streaming import SSE_HEADERS
from pagedllm.entrypoints.openai.tool_calling import ParsedDelta, ToolPlan, plan_tools
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm.server")


class ResponsesServer:
    """`store`: None when the store is off (--disable-responses-store); `keyed`: the server
    has API keys, so each key sees only its own stored responses."""

    def __init__(self, chat: ChatServer, store: ResponseStore | None, keyed: bool) -> None:
        self.chat = chat
        self.ctx = chat.ctx
        self.store = store
        self.keyed = keyed

    def _owner(self, raw_request: Request) -> str | None:
        return owner_of(raw_request.headers.get("authorization"), self.keyed)

    def _history(self, request: ResponsesRequest, owner: str | None) -> list[dict[str, Any]]:
        """The earlier turns' items of `previous_response_id` (its input, then its output)."""
        rid = request.previous_response_id
        if rid is None:
            return []
        if self.store is None:
            raise OpenAIError("`previous_response_id` needs the response store, which is off "
                              "on this server (--disable-responses-store).", 400,
                              param="previous_response_id")
        entry = self.store.get(rid, owner)
        if entry is None:
            raise OpenAIError(f"Previous response with id '{rid}' not found.", 404,
                              param="previous_response_id")
        return entry.input_items + entry.response["output"]

    # ------------------------------------------------------------------ create

    async def create(self, request: ResponsesRequest, raw_request: Request):
        ctx = self.ctx
        request.check()
        owner = self._owner(raw_request)
        history = self._history(request, owner)
        chat_request = request.to_chat(history)
        lora = ctx.check_model(chat_request.model)
        params = chat_request.to_sampling_params(ctx.generation_defaults)
        params.verify_token_ids(ctx.vocab_size)
        plan = plan_tools(chat_request, ctx.tool_config)
        params = plan.apply(params)
        fields = plan_fields(ctx, chat_request, raw_request, params)
        params = fields.params
        headers = dict(fields.headers)
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s",
                           ignored)
            headers[IGNORED_FIELDS_HEADER] = ",".join(header_value(n) for n in ignored)
        prompt_text, prompt_ids = await ctx.run_tokenizer(
            self.chat._render, chat_request, chat_request.conversation())
        fit_default_max_tokens(ctx, params, len(prompt_ids))
        response_id = new_response_id()
        engine = ctx.async_engine
        log_request(ctx, response_id, prompt_text, params)
        try:
            stream = await engine.add_request(
                response_id, {"prompt": prompt_text, "prompt_token_ids": prompt_ids,
                              "cache_salt": chat_request.cache_salt},
                params, priority=chat_request.priority, lora_request=lora)
        except ValueError as exc:
            raise _grammar_error(request, exc) from None
        turn = _Turn(self, request, response_id, ctx.served_name(request.model), owner,
                     history + request.input_items())
        if request.stream:
            return StreamingResponse(
                turn.stream(raw_request, stream, plan), media_type="text/event-stream",
                headers={**SSE_HEADERS, **headers},
                background=BackgroundTask(engine.abort_unfinished, [stream]))
        final: RequestOutput | None = None
        try:
            async for out in engine.stream_outputs(stream):
                final = out
        finally:
            engine.abort_unfinished([stream])
        return JSONResponse(await turn.full(final, plan), headers=headers)

    # ------------------------------------------------------------------ stored

    def retrieve(self, response_id: str, raw_request: Request) -> dict[str, Any]:
        if raw_request.query_params.get("stream") not in (None, "false"):
            raise OpenAIError("`stream`: replaying a stored response as a stream is not "
                              "supported; retrieve it without stream.", 400, param="stream")
        entry = self.store.get(response_id, self._owner(raw_request)) if self.store else None
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404,
                              param="response_id")
        return entry.response

    def delete(self, response_id: str, raw_request: Request) -> dict[str, Any]:
        if self.store is None or not self.store.delete(response_id, self._owner(raw_request)):
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404,
                              param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def cancel(self, response_id: str, raw_request: Request) -> dict[str, Any]:
        self.retrieve(response_id, raw_request)  # 404 for an unknown id
        raise OpenAIError("Only a background response can be cancelled, and this server runs "
                          "no background responses (`background` is refused).", 400,
                          param="response_id")


def _grammar_error(request: ResponsesRequest, exc: ValueError) -> Exception:
    """A constraint the grammar engine refused, named by its Responses field (the engine names
    chat's `structured_outputs.*`)."""
    text = str(exc)
    if not text.startswith("Invalid structured_outputs."):
        return exc
    fmt = ((request.text or {}).get("format") or {}).get("type")
    param = ("text.format.schema" if fmt == "json_schema" else "text.format" if fmt
             else "tools" if request.tools else None)
    if param is None:
        return exc
    return OpenAIError(f"`{param}`: {text}", 400, param=param)


class _Turn:
    """One request's response: its object, built in full or as a stream, and kept."""

    def __init__(self, server: ResponsesServer, request: ResponsesRequest, response_id: str,
                 model: str, owner: str | None, input_items: list[dict[str, Any]]) -> None:
        self.server = server
        self.request = request
        self.id = response_id
        self.model = model
        self.owner = owner
        self.input_items = input_items
        self.created_at = now_seconds()
        self.stored = bool(request.store) and server.store is not None

    def obj(self, status: str, output: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        return response_object(self.request, self.id, self.created_at, self.model, status,
                               output, self.stored, **kw)

    async def _usage(self, final: RequestOutput, reasoning: str | None) -> dict[str, Any]:
        ctx = self.server.ctx
        n_reasoning = 0
        if reasoning:
            n_reasoning = len(await ctx.run_tokenizer(ctx.encode, reasoning, False))
        c = final.outputs[0]
        return usage(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens,
                     n_reasoning)

    def _keep(self, response: dict[str, Any]) -> None:
        if self.stored and not self.server.store.put(self.owner, response, self.input_items):
            logger.warning("response %s is over --responses-store-max-bytes: not stored", self.id)

    async def full(self, final: RequestOutput | None, plan: ToolPlan) -> dict[str, Any]:
        if final is None:
            raise OpenAIError("The request was aborted.", 500)
        c = final.outputs[0]
        parsed = plan.choice_parser().full(c.text)
        status, incomplete = status_of(c.finish_reason)
        response = self.obj(status, output_items(parsed, status), incomplete=incomplete,
                            usage_=await self._usage(final, parsed.reasoning_content))
        self._keep(response)
        return response

    async def stream(self, raw_request: Request, stream: RequestStream,
                     plan: ToolPlan) -> AsyncIterator[str]:
        engine = self.server.ctx.async_engine
        b = StreamBuilder()
        parser = plan.choice_parser()
        text = ""
        tokens = 0
        try:
            yield b.emit("response.created", response=self.obj("in_progress", []))
            yield b.emit("response.in_progress", response=self.obj("in_progress", []))
            final: RequestOutput | None = None
            finish: str | None = None
            async for out in engine.stream_outputs(stream):
                if await raw_request.is_disconnected():
                    return  # the finally aborts the engine request
                final = out
                c = out.outputs[0]
                tokens += len(c.token_ids)
                finish = c.finish_reason
                if parser.active:
                    text += c.text
                    delta = parser.delta(text, finish is not None)
                else:
                    delta = ParsedDelta(content=c.text)
                for e in b.feed(delta):
                    yield e
            if final is None:
                raise OpenAIError("The request was aborted.", 500)
            status, incomplete = status_of(finish)
            for e in b.finish(status):
                yield e
            reasoning = "".join(part["text"] for item in b.items if item["type"] == "reasoning"
                                for part in item["content"])
            u = await self._usage(final, reasoning)
            u["output_tokens"] = tokens
            u["total_tokens"] = u["input_tokens"] + tokens
            response = self.obj(status, b.items, usage_=u, incomplete=incomplete)
            self._keep(response)
            yield b.emit(f"response.{status}", response=response)
        except Exception as exc:  # the headers are sent: report in the stream
            err = as_openai_error(exc)
            code = "server_error" if err.status >= 500 else "invalid_prompt"
            yield b.emit("response.failed", response=self.obj(
                "failed", b.items, error={"code": code, "message": err.message}))
        finally:
            engine.abort_unfinished([stream])
