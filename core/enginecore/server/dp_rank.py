"""External load balancing over HTTP: which data-parallel replica a request names.

A request names its replica with the body field ``data_parallel_rank`` (an enginecore
extension) or the header ``X-data-parallel-rank`` (the header vLLM's router sends). The
body field wins when both are given; range and liveness are checked by the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from enginecore.server.errors import APIError

HEADER = "X-data-parallel-rank"


def requested_rank(body: Any, request: Request) -> int | None:
    if body.data_parallel_rank is not None:
        rank: int | None = body.data_parallel_rank
        return rank
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise APIError(
            400, f"header {HEADER} must be an integer replica rank, got {raw!r}", param=HEADER
        ) from None
