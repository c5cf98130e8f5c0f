"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    pagedllm serve [MODEL] [--host 127.0.0.1 --port 8000 --api-key KEY ...]
    python -m pagedllm.entrypoints.openai.api_server --model MODEL [flags]

Endpoints: GET (and HEAD) /health, GET /version, /v1/models, /metrics, /dashboard and its data
/v1/internal/engine_state (unless --disable-dashboard; dashboard.py); POST /v1/completions,
/v1/chat/completions, /v1/responses (and GET / DELETE /v1/responses/{id}, its input_items and
cancel; responses.py),
/tokenize, /detokenize; with --enable-lora and runtime updating allowed,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_models.py). Start-up
(serve_start.py): the flags are validated, the port is bound (a busy port fails before the
model loads) and the engine core process(es) are launched before this module is imported; they
load the model while this process imports and loads the tokenizer, then uvicorn serves
(engine/async_engine.py).

Life cycle: SIGTERM drains (new requests get 503, in-flight ones may finish for
--drain-timeout seconds, then exit 0); a second SIGTERM or SIGINT stops at once. If the engine
core dies, its requests fail (503), /health answers 503 and the server exits 1, so that a
supervisor restarts it.

Limits (http_limits.py): a body over --max-request-body-bytes is a 413, a head slower than
--request-header-timeout closes the connection (408), a body slower than --request-body-timeout
is a 408; a request's own chat template needs --trust-request-chat-template (chat.py).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from contextlib import asynccontextmanager

from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from pagedllm import envs
import pagedllm
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.input_processing import check_prompt_chars
from pagedllm.entrypoints.openai.chat import DEFAULT_RENDER_TIMEOUT_S, ChatServer, RequestTemplates
from pagedllm.entrypoints.openai.completions import CompletionServer
from pagedllm.entrypoints.openai.dashboard import install_dashboard, is_dashboard_page
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    as_openai_error,
    error_response,
    install_error_handlers,
)
from pagedllm.entrypoints.openai.http_limits import HTTPLimits, RequestBodyMiddleware
from pagedllm.entrypoints.openai.responses_routes import install_responses
from pagedllm.entrypoints.openai.pooling_routes import PoolingRoutes, add_generation_model_refusals
from pagedllm.entrypoints.openai.lora_models import ServedLoRAs, runtime_updating_allowed
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.completion_protocol import CompletionRequest
from pagedllm.entrypoints.openai.models_protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.request_fields import IGNORED_FIELDS_HEADER, REQUEST_ID_HEADER
from pagedllm.entrypoints.openai.serving import ServerOptions, ServingContext, with_cancellation
from pagedllm.entrypoints.openai.serve_start import ServeStart, bind_socket
from pagedllm.entrypoints.openai.tokenization import TokenizationServer
from pagedllm.entrypoints.openai.uvicorn_serving import Lifecycle, serve_app
from pagedllm.tokenizer import max_chars_per_token

logger = logging.getLogger("pagedllm.server")

API_KEY_ENV = "PAGEDLLM_API_KEY"
UNPROTECTED_PATHS = ("/health", "/metrics")


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <api key>` with one of the keys (health, metrics and
    GETs of the dashboard page's static files are open; its data endpoint is not). Plain ASGI
    (not BaseHTTPMiddleware), so that streaming and disconnect detection pass through as is."""

    def __init__(self, app, api_key: str | list[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self.expected = [f"Bearer {k}".encode() for k in keys]

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or scope.get("path") in UNPROTECTED_PATHS
                or (scope.get("method") == "GET" and is_dashboard_page(scope.get("path", "")))):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode()
        # every key is compared (no early exit), so the time does not tell which one is close
        matches = [secrets.compare_digest(given, e) for e in self.expected]
        if not any(matches):
            response = error_response("Invalid or missing API key: send "
                                      "'Authorization: Bearer <api key>'.", 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class InFlightMiddleware:
    """Counts requests in flight (a streaming response until its last byte) and answers 503
    to new ones while the server drains. Plain ASGI: streaming passes through as is."""

    def __init__(self, app, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        life = self.lifecycle
        if life.draining_since is not None or life.fatal is not None:
            why = life.fatal or "The server is shutting down."
            await error_response(why, 503)(scope, receive, send)
            return
        life.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            life.in_flight -= 1


@dataclass
class HTTPOptions:
    """The HTTP layer's deployment flags (vLLM's names): CORS, root path, docs; the request
    limits (http_limits.py) and what a request's own chat template may do (chat.py)."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str | None = None
    disable_fastapi_docs: bool = False
    limits: HTTPLimits = field(default_factory=HTTPLimits)
    templates: RequestTemplates = field(default_factory=RequestTemplates)
    dashboard: bool = True  # GET /dashboard and /v1/internal/engine_state (dashboard.py)


def new_app(opts: HTTPOptions, lifecycle: Lifecycle, api_key: str | list[str] | None, lifespan) -> FastAPI:
    """The FastAPI app with what every server of this project shares: OpenAI-style error
    answers, the body limits, the API key, CORS and the in-flight count (generation and
    pooling servers alike)."""
    docs = {} if not opts.disable_fastapi_docs else dict(docs_url=None, redoc_url=None,
                                                         openapi_url=None)
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__,
                  lifespan=lifespan, root_path=opts.root_path or "", **docs)
    install_error_handlers(app)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(RuntimeError)
    async def _runtime_error(_: Request, exc: RuntimeError) -> JSONResponse:
        err = as_openai_error(exc)
        return error_response(err.message, err.status, err.param)

    # innermost: a request's whole body is in, within its size and time limits, before the
    # app reads it; after the key check (no body read for a 401) and inside CORS (its headers)
    app.add_middleware(RequestBodyMiddleware, limits=opts.limits)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # CORS outside the key check: a browser's preflight (OPTIONS) carries no key
    app.add_middleware(CORSMiddleware, allow_origins=opts.allowed_origins,
                       allow_methods=opts.allowed_methods, allow_headers=opts.allowed_headers,
                       allow_credentials=opts.allow_credentials,
                       expose_headers=[REQUEST_ID_HEADER, IGNORED_FIELDS_HEADER])
    app.add_middleware(InFlightMiddleware, lifecycle=lifecycle)  # outermost: sees every request

    return app


def build_app(ctx: ServingContext, api_key: str | list[str] | None = None,
              lifecycle: Lifecycle | None = None,
              http_options: HTTPOptions | None = None) -> FastAPI:
    engine = ctx.async_engine
    lifecycle = lifecycle if lifecycle is not None else Lifecycle()
    opts = http_options or HTTPOptions()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        if ctx.loras is not None:  # --lora-modules: checked and loaded before serving
            for module in ctx.lora_modules:
                await ctx.loras.load(module.name, module.path, module.base_model_name)
        try:
            yield
        finally:
            responses = getattr(app.state, "responses", None)  # generation models only
            if responses is not None:  # running background responses stop first
                await responses.shutdown()
            await engine.shutdown()
            ctx.close()

    app = new_app(opts, lifecycle, api_key, lifespan)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200, or 503 with an OpenAI error body: an engine core is gone, or the scheduler
        stalled once (a bug: unhealthy until restart, though requests are still served)."""
        problem = engine.health_problem()
        if problem is not None:
            return error_response(problem, 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=ctx.model_root, max_model_len=ctx.max_model_len)
                 for name in ctx.model_names]
        if ctx.loras is not None:  # each adapter a model, its parent the base (as vLLM lists them)
            cards += [ModelCard(id=name, root=root, parent=parent, max_model_len=ctx.max_model_len)
                      for name, root, parent in ctx.loras.cards()]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        loras = _runtime_loras(ctx)
        await loras.load(request.lora_name, request.lora_path)
        return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        loras = _runtime_loras(ctx)
        await loras.unload(request.lora_name, request.lora_int_id)
        return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from pagedllm.metrics import CONTENT_TYPE

        if engine.metrics is None:
            raise OpenAIError("Metrics are off.", 404)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    if opts.dashboard:
        install_dashboard(app, engine)
    if engine.pooling_inputs is not None:  # a pooling model: its endpoints, generation's refused
        PoolingRoutes(engine, ctx.model_names).install(app)
        return app
    _install_generation_routes(app, ctx, opts, keyed=bool(api_key))
    return app


def _install_generation_routes(app: FastAPI, ctx: ServingContext, opts: HTTPOptions,
                               keyed: bool = False) -> None:
    """Completions, chat, responses, tokenize / detokenize; the pooling endpoints refused by
    name. `keyed`: the server has API keys (each key sees only its stored responses)."""
    completions = CompletionServer(ctx)
    chat = ChatServer(ctx, opts.templates)
    install_responses(app, chat, keyed)
    tokenization = TokenizationServer(ctx, opts.templates)
    # read here, before the tokenizer thread owns ctx.tokenizer: the event loop reads a number
    chars_per_token = max_chars_per_token(ctx.tokenizer)

    @app.post("/v1/completions")
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request):
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if request.truncate_prompt_tokens is None:  # a cut prompt may be any length
            for prompt in prompts or ():
                if isinstance(prompt, str):
                    check_prompt_chars(prompt, ctx.max_model_len, chars_per_token)
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        return (await tokenization.tokenize(request)).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return (await tokenization.detokenize(request)).model_dump()

    add_generation_model_refusals(app, ctx.model_name)


def _runtime_loras(ctx: ServingContext):
    """The served adapters, when runtime loading is allowed (else a 404, as vLLM has no route)."""
    if ctx.loras is None or not ctx.loras.runtime_updating:
        raise OpenAIError("Runtime LoRA updating is off: start the server with --enable-lora and "
                          "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).", 404)
    return ctx.loras


# ------------------------------------------------------------------------------ start-up

def _http_options(args: argparse.Namespace, limits: HTTPLimits, templates: RequestTemplates) -> HTTPOptions:
    return HTTPOptions(
        allowed_origins=getattr(args, "allowed_origins", ["*"]),
        allowed_methods=getattr(args, "allowed_methods", ["*"]),
        allowed_headers=getattr(args, "allowed_headers", ["*"]),
        allow_credentials=bool(getattr(args, "allow_credentials", False)),
        root_path=getattr(args, "root_path", None),
        disable_fastapi_docs=bool(getattr(args, "disable_fastapi_docs", False)),
        limits=limits, templates=templates,
        dashboard=not getattr(args, "disable_dashboard", False),
    )


def run_server(args: argparse.Namespace, started: ServeStart | None = None) -> int:
    """Validate the flags, bind, start the engine and serve until interrupted. Returns the
    exit code: 0 after a drain or Ctrl-C, 1 if the engine core died, 2 for bad flags.
    `started`: the port and cores that `pagedllm serve` set going before its imports
    (serve_start.py); its flags were checked then."""
    try:
        return _run_server(args, started)
    finally:
        if started is not None and started.cores is not None and not started.claimed:
            started.abandon()


def _run_server(args: argparse.Namespace, started: ServeStart | None) -> int:
    from pagedllm.engine.core_client import EngineCoreStartError
    from pagedllm.entrypoints.arg_utils import (engine_config_from_args, server_extras_from_args,
                                                validate_server_args)
    from pagedllm.model.resolution import serving_runner

    try:
        validate_server_args(args)
        limits = HTTPLimits(
            max_body_bytes=getattr(args, "max_request_body_bytes", HTTPLimits.max_body_bytes),
            header_timeout_s=getattr(args, "request_header_timeout",
                                     HTTPLimits.header_timeout_s),
            body_timeout_s=getattr(args, "request_body_timeout", HTTPLimits.body_timeout_s))
        templates = RequestTemplates(
            trusted=bool(getattr(args, "trust_request_chat_template", False)),
            render_timeout_s=getattr(args, "chat_template_render_timeout",
                                     DEFAULT_RENDER_TIMEOUT_S))
        config = engine_config_from_args(args)
        lora_modules, tool_config = server_extras_from_args(args)
        if started is None:  # an architecture no runner runs: refused before any core starts
            serving_runner(config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if started is not None:
        sock = started.sock
    else:
        try:
            sock = bind_socket(args.host, args.port)
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 2
    try:
        async_engine = AsyncLLMEngine.from_engine_config(
            config, start=started.claim() if started is not None else None)
    except (ValueError, EngineCoreStartError) as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lifecycle = Lifecycle()
    ctx = ServingContext(async_engine, tool_config=tool_config)
    if config.enable_lora:
        ctx.loras = ServedLoRAs(async_engine, ctx.model_names, enabled=True,
                                runtime_updating=runtime_updating_allowed(
                                    bool(getattr(args, "allow_runtime_lora_updating", False))))
        ctx.lora_modules = lora_modules
    ctx.options = ServerOptions(
        log_requests=bool(getattr(args, "enable_log_requests", False)),
        max_log_len=getattr(args, "max_log_len", None),
        enable_prompt_tokens_details=bool(getattr(args, "enable_prompt_tokens_details", False)),
        responses_store=not getattr(args, "disable_responses_store", False),
        responses_store_max_entries=getattr(args, "responses_store_max_entries", 10_000),
        responses_store_max_bytes=getattr(args, "responses_store_max_bytes", 256 * 1024 * 1024),
    )
    api_key = args.api_key or envs.PAGEDLLM_API_KEY or None
    app = build_app(ctx, api_key, lifecycle, _http_options(args, limits, templates))

    def on_fatal(message: str) -> None:
        logger.error("%s Exiting with status 1.", message)
        lifecycle.fatal = message
        lifecycle.exit_code = 1

    async_engine.on_fatal = on_fatal

    try:
        serve_app(app, sock, args, limits, lifecycle, ctx.model_name, api_key)
    finally:
        # The lifespan shut the cores down; a start-up that never reached it must too.
        if async_engine.is_running or not async_engine._started:
            for client in async_engine.clients:
                client.shutdown(5)
    return lifecycle.exit_code


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.entrypoints.arg_utils import add_engine_args, add_server_args

    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai.api_server",
        description="OpenAI-compatible server for pagedllm",
    )
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_server(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
