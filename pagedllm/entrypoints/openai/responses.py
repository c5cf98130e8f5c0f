"""POST /v1/responses, GET / DELETE /v1/responses/{id} (and its input_items), POST
/v1/responses/{id}/cancel: OpenAI's Responses API over the chat completion path
(docs/responses_api.md).

A request becomes a chat completion request (responses_protocol.py), made ready by chat's own
`ChatServer.prepare`: the chat template, images, the tool plan (`tools` / `tool_choice`, the
server's tool and reasoning parsers), structured output (`text.format`), vLLM's request fields;
then one engine request. A background request runs as a task of its own
(responses_background.py).
Its output becomes `output` items (responses_output.py). A finished response is kept in the
response store (response_store.py) unless `store` is false or the store is off; a
`previous_response_id` replays that response's input and output items before the new input,
so the prompt starts with the earlier turn's tokens and the prefix cache serves them.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.request_stream import RequestStream
from pagedllm.entrypoints.openai.chat import ChatServer
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.request_fields import (
    IGNORED_FIELDS_HEADER,
    header_value,
    log_request,
)
from pagedllm.entrypoints.openai.response_store import (
    ResponseStore,
    StoredResponse,
    new_response_id,
    owner_of,
)
from pagedllm.entrypoints.openai.responses_background import BackgroundRun, replay
from pagedllm.entrypoints.openai.responses_items import canonical_items, list_page
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, refuse
from pagedllm.entrypoints.openai.responses_turn import Turn
from pagedllm.entrypoints.openai.streaming import SSE_HEADERS
from pagedllm.entrypoints.openai.tool_calling import ToolPlan

_FUNCTION_FIELD = re.compile(r"(tools\[\d+\])\.function\.")
logger = logging.getLogger("pagedllm.server")


class ResponsesServer:
    """`store`: None when the store is off (--disable-responses-store); `keyed`: the server
    has API keys, so each key sees only its own stored responses."""

    def __init__(self, chat: ChatServer, store: ResponseStore | None, keyed: bool) -> None:
        self.chat = chat
        self.ctx = chat.ctx
        self.store = store
        self.keyed = keyed
        self.runs: dict[str, BackgroundRun] = {}  # running background responses by id

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
        if entry.response["status"] in ("queued", "in_progress"):
            raise OpenAIError(f"Previous response with id '{rid}' is still in progress (a "
                              "background response): wait for it, or cancel it.", 400,
                              param="previous_response_id")
        return entry.input_items + entry.response["output"]

    def _check_effort(self, request: ResponsesRequest, chat: ChatCompletionRequest) -> None:
        """`reasoning.effort` reaches the template as `reasoning_effort` (as in vLLM); a
        template that never reads it would drop it silently, so that is a 400 instead."""
        if (request.reasoning or {}).get("effort") is None:
            return
        template, _ = self.chat.templates.resolve(chat.chat_template, chat.chat_template_kwargs)
        source = template or self.ctx.chat_template or self.ctx.tokenizer.chat_template
        if isinstance(source, dict):  # named templates: any of them
            source = "\n".join(map(str, source.values()))
        if not re.search(r"\breasoning_effort\b", source or ""):
            raise refuse("`reasoning.effort` is not supported by this model: its chat template "
                         "does not read `reasoning_effort`.", "reasoning.effort")

    # ------------------------------------------------------------------ create

    async def create(self, request: ResponsesRequest, raw_request: Request):
        ctx = self.ctx
        request.check()
        if request.background and self.store is None:
            raise refuse("`background` needs the response store, which is off on this server "
                         "(--disable-responses-store).", "background")
        owner = self._owner(raw_request)
        history = self._history(request, owner)
        chat_request = request.to_chat(history, ctx.takes_images)
        self._check_effort(request, chat_request)
        try:
            prep = await self.chat.prepare(chat_request, raw_request)
        except OpenAIError as exc:  # chat's `tools[i].function.x` is `tools[i].x` here (flat tools)
            if exc.param and ".function." in exc.param:
                exc.message = _FUNCTION_FIELD.sub(r"\1.", exc.message)
                exc.param = _FUNCTION_FIELD.sub(r"\1.", exc.param)
                exc.args = (exc.message,)
            raise
        headers = dict(prep.fields.headers)
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s",
                           ignored)
            headers[IGNORED_FIELDS_HEADER] = ",".join(header_value(n) for n in ignored)
        response_id = new_response_id()
        engine = ctx.async_engine
        plan = prep.plan
        log_request(ctx, response_id, prep.prompt_text, prep.params)
        try:
            stream = await engine.add_request(response_id, prep.prompt, prep.params,
                                              priority=chat_request.priority,
                                              lora_request=prep.lora)
        except ValueError as exc:
            raise _grammar_error(request, exc) from None
        turn = Turn(self, request, response_id, ctx.served_name(request.model), owner,
                    history + canonical_items(request.input_items()), len(history))
        if request.background:
            return self._start_background(turn, stream, plan, headers)
        if request.stream:
            return StreamingResponse(
                turn.stream(raw_request, stream, plan), media_type="text/event-stream",
                headers={**SSE_HEADERS, **headers},
                background=BackgroundTask(engine.abort_unfinished, [stream]))
        final = await engine.final_output(stream)
        return JSONResponse(await turn.full(final, plan), headers=headers)

    def _start_background(self, turn: Turn, stream: RequestStream, plan: ToolPlan,
                          headers: dict[str, str]):
        """Kept as `queued` at once (GET sees it), then run by a task of its own; a streaming
        client follows the run's events, and leaving does not stop it."""
        turn.keep(turn.obj("queued", []))
        run = BackgroundRun(turn, stream, plan, lambda r: self.runs.pop(r.turn.id, None))
        self.runs[turn.id] = run
        if turn.request.stream:
            return StreamingResponse(run.follow(), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        return JSONResponse(turn.final, headers=headers)

    # ------------------------------------------------------------------ stored

    def _entry(self, response_id: str, raw_request: Request) -> StoredResponse:
        entry = self.store.get(response_id, self._owner(raw_request)) if self.store else None
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404,
                              param="response_id")
        return entry

    def retrieve(self, response_id: str, raw_request: Request):
        """The stored response; with `stream=true` (a background response only) its events
        after `starting_after`, live while it runs."""
        query = raw_request.query_params
        _refuse_includes(query)
        entry = self._entry(response_id, raw_request)
        if query.get("stream") in (None, "false", "False"):
            return entry.response
        after = _starting_after(query.get("starting_after"))
        run = self.runs.get(response_id)
        if run is not None:
            events = run.follow(after)
        elif entry.events is not None:
            events = replay(entry.events, after)
        else:
            raise OpenAIError("`stream`: only a background response can be streamed again; "
                              "retrieve this one without stream.", 400, param="stream")
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    def input_items(self, response_id: str, raw_request: Request) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: the items this request sent, paged."""
        query = raw_request.query_params
        _refuse_includes(query)
        entry = self._entry(response_id, raw_request)
        return list_page(entry.own_input_items, query.get("after"), query.get("limit"),
                         query.get("order"))

    def delete(self, response_id: str, raw_request: Request) -> dict[str, Any]:
        if self.store is None or not self.store.delete(response_id, self._owner(raw_request)):
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404,
                              param="response_id")
        run = self.runs.get(response_id)
        if run is not None:  # a running background response: stop it, and keep nothing
            run.turn.stored = False
            run.task.cancel()
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str, raw_request: Request) -> dict[str, Any]:
        """Stop a background response (its output so far is kept, status `cancelled`); a
        finished background response is returned as it is (cancelling is idempotent)."""
        entry = self._entry(response_id, raw_request)
        if not entry.response.get("background"):
            raise OpenAIError("Only a background response (created with `background`: true) "
                              "can be cancelled.", 400, param="response_id")
        run = self.runs.get(response_id)
        if run is None:
            return entry.response
        return await run.cancel()


    async def shutdown(self) -> None:
        """Cancel the running background responses (the server is stopping)."""
        for run in list(self.runs.values()):
            await run.cancel()


def _refuse_includes(query: Any) -> None:
    if query.getlist("include") or query.getlist("include[]"):
        raise OpenAIError("`include`: no extra output data can be included (no hosted tools, "
                          "no logprobs, no encrypted reasoning).", 400, param="include")
    if query.get("include_obfuscation") in ("true", "True", "1"):
        raise OpenAIError("`include_obfuscation`: stream obfuscation is not supported.", 400,
                          param="include_obfuscation")


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        n = int(value)
    except ValueError:
        n = -2
    if n < -1:
        raise OpenAIError(f"`starting_after` must be a sequence number (an integer >= 0), got "
                          f"{value!r}.", 400, param="starting_after")
    return n


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
