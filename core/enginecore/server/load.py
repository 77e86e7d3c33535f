"""``GET /load`` (vLLM's server load tracking): how many generation requests the server is
serving, counted from their arrival until their response's last byte (streams included),
for load balancers that route by it. Counting is on with ``enable_server_load_tracking``;
off, ``/load`` answers 0, as vLLM's does."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

router = APIRouter()

#: The routes whose requests count (generation and pooling work, not probes or metadata).
COUNTED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/pooling",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/invocations",
    }
)


class ServerLoad:
    """The number of counted requests in flight."""

    def __init__(self) -> None:
        self.in_flight = 0


class LoadTrackingMiddleware:
    """Counts each request to a :data:`COUNTED_PATHS` route while it is served."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in COUNTED_PATHS:
            return await self.app(scope, receive, send)
        self.load.in_flight += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.load.in_flight -= 1

        async def counted_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()

        try:
            await self.app(scope, receive, counted_send)
        finally:
            finish()  # an exception or a client gone before the last byte


@router.get("/load")
async def server_load(request: Request) -> dict[str, Any]:
    load: ServerLoad = request.app.state.server_load
    return {"server_load": load.in_flight}
