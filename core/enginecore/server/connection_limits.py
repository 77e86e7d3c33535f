"""Open connections and slow clients: what uvicorn's HTTP protocol is given to bound.

uvicorn on its own keeps a connection that never finishes its headers open forever, and
its ``limit_concurrency`` answers every request 503 once full, ``/health`` included. The
protocol here (uvicorn's httptools protocol, with three additions) instead:

* disconnects a client that takes longer than ``server.request_header_timeout`` to send
  a request's headers, or ``server.request_body_timeout`` to send its body;
* past ``server.max_open_connections`` answers a new request 503 with ``Retry-After`` at
  once (the probes ``/health``, ``/ping``, ``/metrics`` and ``/version`` still answer);
* past that limit plus :data:`PROBE_RESERVE` closes a new connection at once, so a flood
  cannot exhaust the process's file descriptors;
* the same per client address with ``server.max_open_connections_per_client``, so one
  address cannot hold every connection while others are refused.

The limit is also kept below the process's open-file limit (``RLIMIT_NOFILE``), with
room for the engine's own sockets and files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from typing import Any

from enginecore.config import ServerConfig
from enginecore.server.security import PUBLIC_PATHS

logger = logging.getLogger("enginecore.server")

#: Connections beyond ``max_open_connections`` still accepted, for probes to get through.
PROBE_RESERVE = 64
#: File descriptors kept for everything but HTTP connections (engine sockets, files).
_FDS_KEPT = 256


def effective_max_connections(configured: int) -> int:
    """``configured``, lowered to fit the open-file limit (logged when lowered)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    room = max(soft - _FDS_KEPT - PROBE_RESERVE, 1)
    if configured > room:
        logger.warning(
            "max_open_connections %d lowered to %d: the open-file limit is %d (ulimit -n)",
            configured,
            room,
            soft,
        )
        return room
    return configured


async def _overloaded(scope: Any, receive: Any, send: Any) -> None:
    await _refuse(
        send,
        "the server has too many open connections (server limit max_open_connections); retry later",
    )


async def _overloaded_by_client(scope: Any, receive: Any, send: Any) -> None:
    await _refuse(
        send,
        "this client address has too many open connections (server limit "
        "max_open_connections_per_client); close some, then retry",
    )


async def _refuse(send: Any, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def http_protocol(limits: ServerConfig) -> type[Any] | None:
    """uvicorn's ``http=`` protocol class enforcing ``limits``; None where httptools (the
    parser it extends) is not installed, and uvicorn's own protocol is used unbounded."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    max_open = effective_max_connections(limits.max_open_connections)
    per_client = limits.max_open_connections_per_client
    header_timeout = limits.request_header_timeout
    body_timeout = limits.request_body_timeout
    open_per_client: Counter[str] = Counter()  # this server's connections by address

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _read_timer: asyncio.TimerHandle | None = None
        _address: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
            self._address = address
            open_per_client[address] += 1
            if (
                len(self.connections) > max_open + PROBE_RESERVE
                or open_per_client[address] > per_client + PROBE_RESERVE
            ):
                transport.close()  # a flood: refuse before it costs more than a socket
                return
            self._arm(header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            address, self._address = self._address, None
            if address is not None:
                left = open_per_client[address] - 1
                if left > 0:
                    open_per_client[address] = left
                else:
                    del open_per_client[address]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self._read_timer is None:
                self._arm(header_timeout)  # the first bytes of a next request
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._arm(body_timeout)
            if len(self.connections) > max_open:
                refusal = _overloaded
            elif self._address is not None and open_per_client[self._address] > per_client:
                refusal = _overloaded_by_client
            else:
                refusal = None
            if refusal and self.url.split(b"?", 1)[0].decode("latin-1") not in PUBLIC_PATHS:
                app, self.app = self.app, refusal
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
                return
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _too_slow(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return BoundedHttpToolsProtocol
