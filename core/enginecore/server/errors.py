"""OpenAI-style error bodies, and the exception handlers that turn every failure into one.

Every error the server returns looks like OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": 400}}

Malformed input (bad JSON, wrong types, values out of range, unknown model, a prompt too
long for the model) is a 400, never a 500.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from enginecore.engine.async_llm import RequestRejectedError
from enginecore.errors import EngineDeadError, EngineShutdownError, InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by route code to answer with a given status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def status_of(exc: BaseException) -> int:
    """The HTTP status an exception from the engine maps to."""
    if isinstance(exc, APIError):
        return exc.status
    if isinstance(exc, RequestRejectedError):
        if exc.kv_transfer_failed:
            return 502
        return 503 if exc.retryable else 400
    if isinstance(exc, EngineDeadError | EngineShutdownError):
        return 503
    if isinstance(exc, InvalidRequestError):
        return 400
    return 500


#: Seconds a client is told to wait before retrying a 503 (saturated, paused, asleep).
RETRY_AFTER_S = 1


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return (
                f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                None,
            )
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        msg = err.get("msg")
        if err.get("type") == "extra_forbidden":
            # Never silently ignored: the request would succeed without what it asked for.
            msg = "this server does not support this field (docs/serving.md lists those it does)"
        parts.append(f"{where}: {msg}" if where else str(msg))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(status_of(exc), str(exc))

    for cls in (InvalidRequestError, RequestRejectedError, EngineDeadError, EngineShutdownError):
        app.add_exception_handler(cls, _engine_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
