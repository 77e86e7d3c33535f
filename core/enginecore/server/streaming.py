"""Server-sent events, merging several request streams, and watching for disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
#: Seconds between checks whether a non-streaming client is still connected.
DISCONNECT_POLL = 0.5

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as ``(index, item)``; closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            queue.put_nowait((index, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each stream's own cleanup aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


async def aborting_when_left(
    body: AsyncIterator[str], engine: Any, request_id: str
) -> AsyncIterator[str]:
    """A streamed response body that aborts its request when it ends early. A body that
    yields before it first reads the engine's stream (a chat's role chunk) would
    otherwise leave the request running to its end when the client leaves right then:
    the engine stream's own cleanup runs only once it was started."""
    completed = False
    try:
        async for chunk in body:
            yield chunk
        completed = True
    finally:
        if not completed:
            engine.abort(request_id)


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it and raise."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
