"""Time limits for plugin code that runs in the frontend: stat loggers, tool parsers and
reasoning parsers.

The frontend serves every client from one event loop (``AsyncLLM``, the API server) or
one thread (``LLM``), so a plugin call that never returns would freeze all of them. Each
such call runs on a daemon :class:`~enginecore.engine.serial_thread.SerialThread` owned
by the plugin object, and the caller waits at most ``engine.frontend_plugin_timeout``
seconds; past it :class:`PluginCallTimeout` is raised and the stuck thread is abandoned
(it never keeps the process alive). A stat logger's per-step ``record`` is not waited
for at all (:mod:`enginecore.metrics.logger_lane`); a call of it past the limit is
noticed at the logger's next call.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from enginecore.engine.serial_thread import SerialThread

#: The config key of the limit, named in every error past it.
TIMEOUT_KEY = "engine.frontend_plugin_timeout"


class PluginCallTimeout(TimeoutError):
    """A frontend plugin call did not return within its limit."""


def call_bounded(
    thread: SerialThread,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout: float,
    kwargs: dict[str, Any] | None = None,
    abandoned: Callable[[Future[Any]], None] | None = None,
) -> Any:
    """``fn(*args, **kwargs)`` on ``thread``, waiting at most ``timeout`` seconds; past
    it the call's future (still running) is handed to ``abandoned``."""
    future = thread.submit(fn, *args, **(kwargs or {}))
    try:
        return future.result(timeout)
    except FutureTimeout:
        if abandoned is not None:
            abandoned(future)
        raise timed_out(timeout) from None


def timed_out(timeout: float) -> PluginCallTimeout:
    """The error of a call past its limit, naming the limit and its config key."""
    return PluginCallTimeout(f"did not return within {timeout:g} s (config key {TIMEOUT_KEY})")
