"""ASGI middleware: the API key check and the request body size limit.

Both are plain ASGI wrappers (not FastAPI dependencies) so that they run before any body
is parsed and apply to every route, including ones plugins add later.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from enginecore.server.errors import error_body

Scope = dict[str, Any]

#: Paths anyone may call without the API key (probes and scrapers).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


async def _send_error(send: Any, status: int, message: str, headers=()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path but :data:`PUBLIC_PATHS`.

    That covers every ``/v1`` route and the control endpoints (``/sleep``, ``/pause``,
    ``/collective_rpc``, ...). The comparison is constant-time.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self._expected):
            return await _send_error(
                send,
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                [(b"www-authenticate", b"Bearer")],
            )
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request whose body exceeds ``limit`` bytes, declared or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _send_error(send, 400, "invalid Content-Length header")
                if declared > self.limit:
                    return await self._reject(send)
        received = 0
        rejected = False

        async def limited_receive() -> dict:
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit and not rejected:
                    rejected = True
                    await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send: Any) -> None:
        await _send_error(send, 413, f"request body too large: the limit is {self.limit} bytes")
