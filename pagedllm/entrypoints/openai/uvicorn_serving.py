"""Serving the app with uvicorn and pagedllm's life cycle: the first SIGTERM drains (new
requests get a 503, in-flight ones may finish for --drain-timeout seconds), a dead engine core
ends the server (exit 1) after a short linger of 503s."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import time

from fastapi import FastAPI

from pagedllm.entrypoints.openai.http_limits import HTTPLimits, limited_h11_protocol

logger = logging.getLogger("pagedllm.server")


class Lifecycle:
    """Draining after SIGTERM and the process's exit code; counts the HTTP requests in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining_since: float | None = None
        self.exit_code = 0
        self.fatal: str | None = None



class _Server:
    """uvicorn's server with pagedllm's life cycle: the first SIGTERM drains instead of
    closing the listening socket (so that new requests get a 503, not a refused connection)."""

    def __new__(cls, config, lifecycle: Lifecycle, drain_timeout: float):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if sig == signal.SIGTERM and lifecycle.draining_since is None \
                        and lifecycle.fatal is None:
                    lifecycle.draining_since = time.monotonic()
                    logger.info("SIGTERM: draining (%d request(s) in flight, up to %.0f s)",
                                lifecycle.in_flight, drain_timeout)
                    return
                super().handle_exit(sig, frame)

        return Server(config)


FATAL_LINGER_S = 1.0  # after the engine died: answer 503 this long, then exit 1


async def _watch_lifecycle(server, lifecycle: Lifecycle, drain_timeout: float) -> None:
    """Ends the server when a drain is over, or shortly after the engine is gone (meanwhile
    every request, /health included, gets a 503 naming why)."""
    fatal_since = None
    while not server.should_exit:
        await asyncio.sleep(0.05)
        if lifecycle.fatal is not None:
            fatal_since = fatal_since or time.monotonic()
            if time.monotonic() - fatal_since >= FATAL_LINGER_S:
                server.should_exit = True
        elif lifecycle.draining_since is not None:
            waited = time.monotonic() - lifecycle.draining_since
            if lifecycle.in_flight == 0 or waited >= drain_timeout:
                if lifecycle.in_flight:
                    logger.warning("Drain timeout: %d request(s) still in flight are cut",
                                   lifecycle.in_flight)
                server.should_exit = True


def serve_app(app: FastAPI, sock: socket.socket, args: argparse.Namespace, limits: HTTPLimits,
              lifecycle: Lifecycle, model_name: str, api_key: str | None) -> None:
    """Serve `app` with uvicorn on the bound socket until a drain or an interrupt ends it."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ssl_keyfile = getattr(args, "ssl_keyfile", None)
    scheme = "https" if ssl_keyfile else "http"
    logger.info("Serving %s on %s://%s:%d (OpenAI API under /v1)%s", model_name, scheme,
                shown, port, "; API key required" if api_key else "")
    drain_timeout = float(getattr(args, "drain_timeout", 30.0))
    ssl_kwargs = {}
    if ssl_keyfile:
        ssl_kwargs = dict(ssl_keyfile=ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
                          ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0))
    server = _Server(uvicorn.Config(
        app, http=limited_h11_protocol(limits), log_level=args.uvicorn_log_level,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        **ssl_kwargs,
    ), lifecycle, drain_timeout)

    async def serve() -> None:
        watcher = asyncio.ensure_future(_watch_lifecycle(server, lifecycle, drain_timeout))
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()

    asyncio.run(serve())
