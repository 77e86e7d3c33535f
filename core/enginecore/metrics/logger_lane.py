"""One stat logger's calls on a thread of its own, handed over without waiting.

The engine's step must not wait for a plugin's metrics push, yet a logger that hangs or
raises has to be noticed and a slow one must not hold memory without bound. A lane keeps
the records handed to its logger and not yet run (at most :data:`MAX_PENDING_RECORDS`)
and knows which call runs now and since when, so the caller can check at its next call,
without waiting, whether an earlier one raised or has run past its time limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

from enginecore.engine.serial_thread import SerialThread
from enginecore.frontend_plugin_calls import timed_out

#: Records a busy logger may have waiting; more are dropped (and counted by the caller).
#: Several, not one: a healthy logger's thread can miss a step or two while the engine's
#: threads hold the interpreter, and its counters should not lose those steps.
MAX_PENDING_RECORDS = 16

#: An earlier call that failed: the logger method's name and what it raised.
Failure = tuple[str, BaseException]


class LoggerLane:
    """The calls of one logger, in order, on one :class:`SerialThread`."""

    def __init__(self, name: str) -> None:
        self.thread = SerialThread(name)
        self._pending: deque[tuple[str, Future[Any]]] = deque()
        self._running: str | None = None  # the method running now, set by the thread
        self._started = 0.0  # when it started (time.monotonic)

    def submit(self, method: str, call: Callable[..., Any], args: tuple[Any, ...]) -> bool:
        """Hand ``call(*args)`` over; False (nothing submitted) while the logger already
        has :data:`MAX_PENDING_RECORDS` calls waiting or running."""
        while self._pending and self._pending[0][1].done() and not _raised(self._pending[0]):
            self._pending.popleft()
        if len(self._pending) >= MAX_PENDING_RECORDS:
            return False
        self._pending.append((method, self.thread.submit(self._run, method, call, args)))
        return True

    def _run(self, method: str, call: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._started = time.monotonic()
        self._running = method
        try:
            return call(*args)
        finally:
            self._running = None

    def failure(self, timeout: float) -> Failure | None:
        """Without waiting: the first earlier call that raised, or the one running now if
        it has run longer than ``timeout`` seconds."""
        while self._pending and self._pending[0][1].done():
            method, future = self._pending.popleft()
            exc = future.exception()
            if exc is not None:
                return method, exc
        running = self._running
        if running is not None and time.monotonic() - self._started > timeout:
            return running, timed_out(timeout)
        return None

    def wait(self, timeout: float) -> Failure | None:
        """Wait for every call handed over so far, each at most ``timeout`` seconds; the
        first that raised or did not return in time."""
        while self._pending:
            method, future = self._pending[0]
            if not wait_for([future], timeout).done:
                return self._running or method, timed_out(timeout)
            self._pending.popleft()
            exc = future.exception()
            if exc is not None:
                return method, exc
        return None

    def close(self) -> None:
        """Cancel the calls not started; a hung one keeps only its daemon thread."""
        self._pending.clear()
        self.thread.shutdown(wait=False, cancel_futures=True)


def _raised(entry: tuple[str, Future[Any]]) -> bool:
    return entry[1].exception() is not None
