"""One /v1/responses request's response: built in full, or as its typed event stream, and
kept in the response store (responses.py starts it; responses_background.py runs a
background one to its end whoever listens)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pagedllm.engine.request_stream import RequestStream
from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error
from pagedllm.entrypoints.openai.protocol_base import now_seconds
from pagedllm.entrypoints.openai.responses_output import (
    StreamBuilder,
    output_items,
    response_object,
    status_of,
    usage,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.tool_calling import ParsedDelta, ToolPlan
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.responses import ResponsesServer

logger = logging.getLogger("pagedllm.server")


class Turn:
    """`input_items`: the whole conversation's canonical items (earlier turns first, `n_history`
    of them). A background turn is not kept by `stream` itself: its run keeps the final
    response with the events (`final`)."""

    def __init__(self, server: ResponsesServer, request: ResponsesRequest, response_id: str,
                 model: str, owner: str | None, input_items: list[dict[str, Any]],
                 n_history: int) -> None:
        self.server = server
        self.request = request
        self.id = response_id
        self.model = model
        self.owner = owner
        self.input_items = input_items
        self.n_history = n_history
        self.created_at = now_seconds()
        self.stored = bool(request.store) and server.store is not None
        self.background = bool(request.background)
        self.builder = StreamBuilder()
        self.final: dict[str, Any] | None = None  # the last response object built

    def obj(self, status: str, output: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        return response_object(self.request, self.id, self.created_at, self.model, status,
                               output, self.stored, **kw)

    def keep(self, response: dict[str, Any], events: list[str] | None = None) -> None:
        self.final = response
        if self.stored and not self.server.store.put(self.owner, response, self.input_items,
                                                     self.n_history, events):
            logger.warning("response %s is over --responses-store-max-bytes: not stored", self.id)

    async def _usage(self, final: RequestOutput, reasoning: str | None) -> dict[str, Any]:
        ctx = self.server.ctx
        n_reasoning = 0
        if reasoning:
            n_reasoning = len(await ctx.run_tokenizer(ctx.encode, reasoning, False))
        c = final.outputs[0]
        return usage(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens,
                     n_reasoning)

    async def full(self, final: RequestOutput | None, plan: ToolPlan) -> dict[str, Any]:
        if final is None:
            raise OpenAIError("The request was aborted.", 500)
        c = final.outputs[0]
        parsed = plan.choice_parser().full(c.text, truncated=c.finish_reason == "length")
        status, incomplete = status_of(c.finish_reason)
        response = self.obj(status, output_items(parsed, status), incomplete=incomplete,
                            usage_=await self._usage(final, parsed.reasoning_content))
        self.keep(response)
        return response

    async def stream(self, raw_request: Request | None, stream: RequestStream,
                     plan: ToolPlan) -> AsyncIterator[str]:
        """The events; `raw_request` None for a background turn (no client to lose)."""
        engine = self.server.ctx.async_engine
        b = self.builder
        parser = plan.choice_parser()
        text = ""
        tokens = 0
        try:
            yield b.emit("response.created",
                         response=self.obj("queued" if self.background else "in_progress", []))
            if self.background:
                yield b.emit("response.queued", response=self.obj("queued", []))
                self.keep(self.obj("in_progress", []))
            yield b.emit("response.in_progress", response=self.obj("in_progress", []))
            final: RequestOutput | None = None
            finish: str | None = None
            async for out in engine.stream_outputs(stream):
                if raw_request is not None and await raw_request.is_disconnected():
                    return  # the finally aborts the engine request
                final = out
                c = out.outputs[0]
                tokens += len(c.token_ids)
                finish = c.finish_reason
                if parser.active:
                    text += c.text
                    delta = parser.delta(text, finish is not None, truncated=finish == "length")
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
            if self.background:
                self.final = response
            else:
                self.keep(response)
            yield b.emit(f"response.{status}", response=response)
        except Exception as exc:  # the headers are sent: report in the stream
            err = as_openai_error(exc)
            code = "server_error" if err.status >= 500 else "invalid_prompt"
            self.final = self.obj("failed", b.items, error={"code": code, "message": err.message})
            yield b.emit("response.failed", response=self.final)
        finally:
            engine.abort_unfinished([stream])
