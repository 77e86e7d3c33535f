"""Calls run one at a time, in order, on one daemon thread that can be abandoned.

A thread cannot be stopped from outside, so plugin code that never returns (an attention
forward, a ``sort_key``, a KV load) holds whatever thread runs it for good. On a
:class:`SerialThread` that thread is a daemon: the caller waits on the call's future
with a time limit, and the process still exits while the call hangs. (The threads of a
``concurrent.futures.ThreadPoolExecutor`` are joined at interpreter exit, so one hung
call there would keep the process alive for good.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class SerialThread:
    """``submit(fn, *args)`` returns a future; calls run in submission order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._closed:
            raise RuntimeError(f"{self.thread.name} is shut down")
        future: Future[Any] = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)
            else:
                future.set_result(result)
            del call, future, fn, args, kwargs  # no reference kept while idle

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop after the calls already submitted (cancelled first with
        ``cancel_futures``); ``wait`` joins the thread unless called from it."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    pending = self._calls.get_nowait()
                except queue.Empty:
                    break
                if pending is not None:
                    pending[0].cancel()
        self._calls.put(None)
        if wait and threading.current_thread() is not self.thread:
            self.thread.join()
