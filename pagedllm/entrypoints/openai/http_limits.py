"""HTTP-layer limits, so that one client cannot take the server by sending slowly or a lot.

- `RequestBodyMiddleware` (plain ASGI, so that streaming responses pass through as is) reads
  a request's body before the app does: 413 when it is larger than `--max-request-body-bytes`
  (at once from Content-Length, else as the chunks come in), 408 when it has not all come
  within `--request-body-timeout` seconds of the head. The app then gets the body in one
  message; nothing is tokenized or parsed before the whole body is in and small enough.
- `limited_h11_protocol(...)` is uvicorn's h11 protocol with a deadline for the request head
  (`--request-header-timeout`: a connection whose head is not complete in time gets a 408 and
  is closed) and for reading the rest of a body that was answered early (413): it is read and
  dropped, so that the client sees the answer, for at most the body timeout, then closed.
  Connections waiting for a head never reach the app, so they never count as in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
from starlette.datastructures import Headers
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import error_body, error_response

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class HTTPLimits:
    """--max-request-body-bytes, --request-header-timeout, --request-body-timeout."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-request-body-bytes must be a positive number of bytes, "
                             f"got {self.max_body_bytes}.")
        for flag, value in (("--request-header-timeout", self.header_timeout_s),
                            ("--request-body-timeout", self.body_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}.")


def _has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0") != "0"


class RequestBodyMiddleware:
    """Reads the whole body first, within a size and a time limit (module docstring)."""

    def __init__(self, app, limits: HTTPLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._too_large(scope, receive, send, int(length))
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return  # answered (413 / 408), or the client is gone
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # later messages: the client's disconnect, as before
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                await self._timed_out(scope, receive, send, total)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limits.max_body_bytes:
                await self._too_large(scope, receive, send, None)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send,
                         length: int | None) -> None:
        limit = self.limits.max_body_bytes
        size = f"{length} bytes" if length is not None else f"more than {limit} bytes"
        await error_response(
            f"The request body is {size}; this server takes at most {limit} bytes "
            "(--max-request-body-bytes).", 413)(scope, receive, send)

    async def _timed_out(self, scope: Scope, receive: Receive, send: Send, got: int) -> None:
        response = error_response(
            f"The request body did not arrive within {self.limits.body_timeout_s:g} s "
            f"(--request-body-timeout); {got} bytes came.", 408)
        response.headers["Connection"] = "close"  # uvicorn then closes the connection
        await response(scope, receive, send)


def _raw_408(timeout_s: float) -> bytes:
    """A whole HTTP/1.1 408 answer, written before any request exists (h11 cannot)."""
    body = json.dumps(error_body(f"The request head did not arrive within {timeout_s:g} s "
                                 "(--request-header-timeout).", 408)).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline and a bounded read of an unread body.

    The head deadline runs from the connection's start, and for each later request on a
    kept-alive connection from its first byte (an idle kept-alive connection is uvicorn's
    --timeout-keep-alive's). `limited_h11_protocol` sets the two class attributes."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    linger_s: float = DEFAULT_BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_kind: str | None = None
        self._no_request_yet = True

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def _update_deadline(self) -> None:
        if self.transport is None or self.transport.is_closing():
            self._set_deadline(None)
            return
        conn = self.conn
        kind = None
        if conn.their_state is h11.IDLE:
            if self._no_request_yet or conn.trailing_data[0]:
                kind = "head"  # a head is (or should be) on its way
        else:
            self._no_request_yet = False
            if conn.their_state is h11.SEND_BODY and conn.our_state in (h11.DONE, h11.MUST_CLOSE):
                kind = "linger"  # answered before the body was read (413): drop the rest
        self._set_deadline(kind)

    def _set_deadline(self, kind: str | None) -> None:
        if kind == self._deadline_kind:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_kind = kind
        if kind is not None:
            delay = self.header_timeout_s if kind == "head" else self.linger_s
            self._deadline = self.loop.call_later(delay, self._expire, kind)

    def _expire(self, kind: str) -> None:
        self._deadline, self._deadline_kind = None, None
        if self.transport.is_closing():
            return
        if kind == "head":
            logger.debug("closing a connection whose request head took over %.3g s",
                         self.header_timeout_s)
            self.transport.write(_raw_408(self.header_timeout_s))
        self.transport.close()


def limited_h11_protocol(limits: HTTPLimits) -> type[LimitedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits' timeouts."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {
        "header_timeout_s": limits.header_timeout_s, "linger_s": limits.body_timeout_s})
