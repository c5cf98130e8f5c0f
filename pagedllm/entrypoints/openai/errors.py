"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`type` is the name of the exception class the official `openai` client raises for the status
(as vLLM does), `code` the HTTP status. Every failure of a request ends here as a JSON answer;
none escapes to kill the server.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.errors import SchedulerStallError
from pagedllm.entrypoints.openai.protocol_base import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """Raised by the serving code; answered as `status` with OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    err = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"), param=param,
                    code=status)
    return ErrorResponse(error=err).model_dump()


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def sse_error(error: OpenAIError) -> str:
    """An error inside an already started stream: one SSE event with the error body."""
    return f"data: {json.dumps(error_body(error.message, error.status, error.param))}\n\n"


def as_openai_error(exc: BaseException) -> OpenAIError:
    """Map an exception raised while serving a request to its HTTP answer."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):  # the engine's and SamplingParams' validation errors
        return OpenAIError(str(exc), 400)
    # lazy: async_engine imports torch; the CLI loads this module (through tool_calling) without it
    from pagedllm.engine.async_engine import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), 503)
    if isinstance(exc, SchedulerStallError):  # a server bug, logged by the engine thread
        return OpenAIError(f"Internal server error: {exc}", 500)
    logger.error("request failed: %r", exc, exc_info=exc)
    return OpenAIError(f"Internal server error: {exc!r}", 500)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc and param is None:
            param = loc[0]
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "Invalid request body.", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = as_openai_error(exc)
        return error_response(err.message, err.status, err.param)
