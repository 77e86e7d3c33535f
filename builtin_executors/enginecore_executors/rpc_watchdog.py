"""Registered worker RPCs run where they can be abandoned.

A worker RPC is plugin code called on a worker's own loop: one that never returns would
hold the worker, and with it every later step, for good. :func:`call_within` runs it on
a thread of its own and waits at most ``limit`` seconds; past that the caller gets an
error naming the RPC and the worker goes on serving, the stuck thread left behind (it
cannot be stopped from outside, and it holds no lock of the worker's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from enginecore.errors import EngineCoreError


class WorkerRPCTimeoutError(EngineCoreError, TimeoutError):
    """A registered worker RPC did not return within its limit; it was abandoned."""


def call_within(
    fn: Callable[..., Any], name: str, rank: int, limit: float, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread; its result, its exception re-raised, or
    :class:`WorkerRPCTimeoutError` once ``limit`` seconds have passed."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"enginecore-rpc-{name}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise WorkerRPCTimeoutError(
            f"worker RPC {name!r} did not return within {limit:g} s on rank {rank}; it was "
            "abandoned (its thread is left running) and the worker goes on serving. Pass a "
            "larger timeout, or raise engine.rpc_timeout, if it needs longer."
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")
