"""`pagedllm serve` for a pooling model: the shared app (errors, limits, API key, CORS),
/health, /version, /v1/models, the pooling endpoints (pooling_routes.py) over an
`AsyncPoolingEngine`, served by the same uvicorn set-up as generation."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import Response

from pagedllm import envs
import pagedllm
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.entrypoints.openai.http_limits import HTTPLimits
from pagedllm.entrypoints.openai.pooling_routes import PoolingRoutes
from pagedllm.entrypoints.openai.models_protocol import ModelCard, ModelList
from pagedllm.pooling.async_engine import AsyncPoolingEngine

logger = logging.getLogger("pagedllm.server")


def build_pooling_app(engine: AsyncPoolingEngine, model_names: list[str], api_key=None, lifecycle=None,
                      http_options=None) -> FastAPI:
    from pagedllm.entrypoints.openai.api_server import HTTPOptions, Lifecycle, new_app

    lifecycle = lifecycle if lifecycle is not None else Lifecycle()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = new_app(http_options or HTTPOptions(), lifecycle, api_key, lifespan)
    max_len = engine.inputs.max_model_len
    root = engine.inputs.source.path

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        problem = engine.health_problem()
        return error_response(problem, 503) if problem is not None else Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=max_len) for n in model_names]).model_dump()

    PoolingRoutes(engine, model_names).install(app)
    return app


def serve_pooling(args: argparse.Namespace, config: EngineConfig, sock: socket.socket, limits: HTTPLimits,
                  http_options) -> int:
    from pagedllm.entrypoints.openai.api_server import Lifecycle, serve_app

    if getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None):
        sock.close()
        print("error: LoRA adapters apply to generation models, not to pooling models.", file=sys.stderr)
        return 2
    try:
        engine = AsyncPoolingEngine(config)  # the front end's rule here, the model in its own process
    except (ValueError, OSError, RuntimeError) as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    inputs = engine.inputs
    names = config.served_model_names or [inputs.model_name]
    logger.info("Pooling model %s (%s; tasks %s; pooling %s from %s): core process ready in %.1f s",
                inputs.model_name, "encoder" if inputs.is_encoder else "decoder, paged",
                list(inputs.supported_tasks), inputs.pooler.pooling_type, inputs.pooler.source,
                engine.core.startup_seconds)
    lifecycle = Lifecycle()

    def on_fatal(message: str) -> None:
        logger.error("%s Exiting with status 1.", message)
        lifecycle.fatal = message
        lifecycle.exit_code = 1

    engine.on_fatal = on_fatal
    api_key = args.api_key or envs.PAGEDLLM_API_KEY or None
    app = build_pooling_app(engine, names, api_key, lifecycle, http_options)
    try:
        serve_app(app, sock, args, limits, lifecycle, names[0], api_key)
    finally:
        engine.core.shutdown(5)
    return lifecycle.exit_code
