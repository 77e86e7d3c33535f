"""Per-client fairness at the door: a cap on one client's unfinished generation requests.

``server.max_pending_requests`` bounds what the server holds for everyone together; this
ASGI middleware bounds what one client holds, so a single client's flood of long
requests cannot put every other client behind it. A client is its address: the server
has one API key, so the key names no one (behind a proxy every client shares the proxy's
address: raise the limit there).
Beyond ``server.max_pending_requests_per_client`` a new generation request from that
client is answered 429 with ``Retry-After`` before it is parsed; its request counts until
its response has been sent in full (a stream: until it ends or the client disconnects).
Each admitted request carries its client's key (``client`` in ``SamplingParams.extra``),
by which the scheduler bounds one client's requests in a step while others wait
(``scheduler.max_num_seqs_per_client``); under the ``fair_share`` scheduling policy also
its rank among that client's pending requests (``client_rank``), which the policy orders
by, interleaving clients. Both replace whatever the body's metadata says.
"""

from __future__ import annotations

import json
from collections import Counter
from contextvars import ContextVar
from typing import Any

#: Routes whose requests reach the engine (a POST to one of them counts).
GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"}
)

#: The admitted request's ``(client key, rank among its pending requests or None)``.
current_client: ContextVar[tuple[str, int | None] | None] = ContextVar(
    "current_client", default=None
)


def client_fields() -> dict[str, Any]:
    """What the server adds to the admitted request's ``SamplingParams.extra``."""
    admitted = current_client.get()
    if admitted is None:
        return {}
    key, rank = admitted
    return {"client": key} if rank is None else {"client": key, "client_rank": rank}


def client_key(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class ClientQuota:
    """ASGI middleware: at most ``limit`` unfinished generation requests per client."""

    def __init__(self, app: Any, limit: int, rank_requests: bool = False) -> None:
        self.app = app
        self.limit = limit
        self.rank_requests = rank_requests
        self.pending: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        key = client_key(scope)
        held = self.pending[key]
        if held >= self.limit:
            await _too_many(send, held, self.limit)
            return
        self.pending[key] = held + 1
        token = current_client.set((key, held if self.rank_requests else None))
        try:
            await self.app(scope, receive, send)
        finally:
            current_client.reset(token)
            left = self.pending[key] - 1
            if left > 0:
                self.pending[key] = left
            else:
                del self.pending[key]


async def _too_many(send: Any, held: int, limit: int) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"this client already has {held} unfinished requests (server "
                f"limit max_pending_requests_per_client={limit}); retry when one finishes",
                "type": "RateLimitError",
                "code": 429,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
