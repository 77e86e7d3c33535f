"""One stat logger's calls on a thread of its own, handed over without waiting.

The engine's step must not wait for a plugin's metrics push, nor pay a thread wake-up
per step, yet a logger that hangs or raises has to be noticed and a slow one must not
hold memory without bound. A lane keeps its logger's calls in order in a deque: handing
a record over is an append. Its daemon thread, once woken, runs what is there, then
lingers :data:`LINGER_S` and runs what came meanwhile, so a logger's thread wakes at
most once per linger however short the steps (a call someone waits for, as
:meth:`LoggerLane.wait`'s, cuts the linger short). At most :data:`MAX_PENDING_RECORDS`
records wait; the caller drops and counts the rest. The lane knows which call runs now
and since when, and the first record that raised, so the caller can check at its next
call, without waiting, whether an earlier one failed or has run past its time limit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

from enginecore.frontend_plugin_calls import timed_out

#: Records a busy logger may have waiting; more are dropped (and counted by the caller).
#: Room for the steps of several lingers, so a healthy logger loses none.
MAX_PENDING_RECORDS = 32

#: How long a woken logger thread waits for more calls before it sleeps again.
LINGER_S = 0.005

#: An earlier call that failed: the logger method's name and what it raised.
Failure = tuple[str, BaseException]

# method, the call, its arguments, and the future of a call someone waits for
_Call = tuple[str, Callable[..., Any], tuple[Any, ...], "Future[Any] | None"]


class LoggerLane:
    """The calls of one logger, in order, on one daemon thread."""

    def __init__(self, name: str) -> None:
        self._calls: deque[_Call] = deque()
        self._wake = threading.Event()
        self._asleep = True  # the thread waits for ``_wake``: the next call sets it
        self._closed = False
        # Records handed over and records run: each counted by one thread alone.
        self._handed = 0
        self._ran = 0
        self._running: str | None = None  # the method running now, set by the thread
        self._started = 0.0  # when it started (time.monotonic)
        self._progress = time.monotonic()  # when a call last started or ended
        self._raised: Failure | None = None  # the first record that raised
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, method: str, call: Callable[..., Any], args: tuple[Any, ...]) -> bool:
        """Hand a record over; False (nothing handed over) while the logger already has
        :data:`MAX_PENDING_RECORDS` waiting."""
        if self._handed - self._ran >= MAX_PENDING_RECORDS:
            return False
        self._handed += 1
        self._calls.append((method, call, args, None))
        if self._asleep:
            self._asleep = False
            self._wake.set()
        return True

    def call(self, method: str, call: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
        """Hand over a call someone waits for: its future, done after the earlier calls."""
        future: Future[Any] = Future()
        self._calls.append((method, call, args, future))
        self._asleep = False
        self._wake.set()
        return future

    def _run(self) -> None:
        calls = self._calls
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                while calls and not self._closed:
                    self._run_one(*calls.popleft())
                # The next steps' records, run in this wake-up; a call someone waits for
                # (or close) cuts the linger short.
                if self._wake.wait(LINGER_S):
                    self._wake.clear()
                    continue
                if not calls:
                    self._asleep = True
                    if not calls:  # a call that came just now saw the thread awake
                        break
                    self._asleep = False
            if self._closed:
                return

    def _run_one(
        self,
        method: str,
        call: Callable[..., Any],
        args: tuple[Any, ...],
        future: Future[Any] | None,
    ) -> None:
        if future is None:
            self._ran += 1
        elif not future.set_running_or_notify_cancel():
            return
        self._started = self._progress = time.monotonic()
        self._running = method
        try:
            result = call(*args)
        except BaseException as exc:  # handed to the caller, whatever it is
            if future is not None:
                future.set_exception(exc)
            elif self._raised is None:
                self._raised = (method, exc)
        else:
            if future is not None:
                future.set_result(result)
        finally:
            self._running = None
            self._progress = time.monotonic()
        del call, args, future  # no reference kept while idle

    def failure(self, timeout: float) -> Failure | None:
        """Without waiting: the first earlier record that raised, or the call running
        now if it has run longer than ``timeout`` seconds."""
        if self._raised is not None:
            return self._raised
        running = self._running
        if running is not None and time.monotonic() - self._started > timeout:
            return running, timed_out(timeout)
        return None

    def wait(self, timeout: float) -> Failure | None:
        """Wait until the calls handed over so far have run, none of them running longer
        than ``timeout`` seconds; the first that raised or did not return in time. A
        thread that takes no call for ``timeout`` seconds (it ended, or the interpreter
        is shutting down and holds it) counts as hung too."""
        since = time.monotonic()
        done = self.call("flush", _nothing, ())
        while not wait_for([done], min(timeout, 0.05)).done:
            failure = self.failure(timeout)
            if failure is not None:
                return failure
            idle = time.monotonic() - max(since, self._progress)
            if self._running is None and idle > timeout:
                return "flush", timed_out(timeout)
        return self.failure(timeout)

    def close(self) -> None:
        """Drop the calls not started (their waiters are cancelled) and let the thread
        end; a hung call keeps only its daemon thread."""
        self._closed = True
        while self._calls:
            future = self._calls.popleft()[3]
            if future is not None:
                future.cancel()
        self._wake.set()


def _nothing() -> None:
    """The marker :meth:`LoggerLane.wait` waits for."""
