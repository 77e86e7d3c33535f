"""ASGI middleware: the API key check and the request body size limit.

Both are plain ASGI wrappers (not FastAPI dependencies) so that they run before any body
is parsed and apply to every route, including ones plugins add later.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Send

from enginecore.server.errors import error_body

Scope = dict[str, Any]

#: Paths anyone may call without the API key (probes, scrapers and load balancers).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


async def _send_error(
    send: Send, status: int, message: str, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
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

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

        async def limited_receive() -> Message:
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit and not rejected:
                    rejected = True
                    await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send: Send) -> None:
        await _send_error(send, 413, f"request body too large: the limit is {self.limit} bytes")


#: Methods that change state: a browser may send them cross-site without asking first.
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The bind address and the localhost names; any name when bound to all interfaces."""
    if bind_host in ANY_ADDRESS:
        return ["*"]
    return [bind_host, *(h for h in LOCAL_HOSTS if h != bind_host)]


def _host_name(value: str) -> str:
    """``Host`` header -> the name without the port (``[::1]:8000`` -> ``::1``)."""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class BrowserGuardMiddleware:
    """Keeps web pages from driving the server through a visitor's browser.

    - ``Host`` must be one of ``allowed_hosts`` (a page that re-points its own DNS name at
      127.0.0.1 still sends its own name: DNS rebinding fails here).
    - A state-changing request that carries an ``Origin`` other than the server's own
      must come from one of ``allowed_origins`` (browsers always send ``Origin``
      cross-site; API clients do not).
    - A state-changing request with a body must declare ``application/json``: the
      content types a page may send without a CORS preflight (``text/plain``, forms)
      are refused.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: list[str], allowed_origins: list[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {h.lower().strip("[]") for h in allowed_hosts}
        self.any_origin = "*" in allowed_origins
        self.origins = {o.lower().rstrip("/") for o in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
        }
        host = headers.get("host", "")
        if not self.any_host and _host_name(host).lower() not in self.hosts:
            return await _send_error(
                send, 400, f"Host {host!r} is not served here (server setting allowed_hosts)"
            )
        if scope["method"] not in STATE_CHANGING:
            return await self.app(scope, receive, send)
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return await _send_error(
                send,
                403,
                f"cross-origin request from {origin!r} refused (server setting allowed_origins)",
            )
        content_type = headers.get("content-type")
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if (content_type is not None or has_body) and not _is_json(content_type):
            return await _send_error(
                send,
                415,
                f"Content-Type must be application/json, got {content_type or 'none'}",
            )
        return await self.app(scope, receive, send)

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.lower().rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        return origin in (f"http://{host.lower()}", f"https://{host.lower()}")  # same origin


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and (
        content_type.split(";", 1)[0].strip().lower() == "application/json"
    )
