"""The /v1/responses routes (responses.py serves them): create, retrieve, input items, delete,
cancel."""

from __future__ import annotations

from fastapi import FastAPI, Request

from pagedllm.entrypoints.openai.chat import ChatServer
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.responses import ResponsesServer
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving import with_cancellation


def install_responses(app: FastAPI, chat: ChatServer, keyed: bool) -> ResponsesServer:
    """Add the routes; the store's bounds come from the server options (ServerOptions)."""
    opts = chat.ctx.options
    store = (ResponseStore(opts.responses_store_max_entries, opts.responses_store_max_bytes)
             if opts.responses_store else None)
    server = ResponsesServer(chat, store, keyed)

    @app.post("/v1/responses")
    @with_cancellation
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await server.create(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request):
        return server.retrieve(response_id, raw_request)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, raw_request: Request) -> dict:
        return server.input_items(response_id, raw_request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw_request: Request) -> dict:
        return server.delete(response_id, raw_request)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw_request: Request) -> dict:
        return await server.cancel(response_id, raw_request)

    app.state.responses = server  # tests and the dashboard may read the store
    return server
