"""When a worker in the engine's process has staged a step's inputs.

With async scheduling the engine thread does its Python for step N (``update_from_output``,
the step's stats and outputs, then the frontend's output processing) while the worker
runs step N+1. With the ``uni`` executor both threads share one interpreter lock. The
worker's input preparation is Python too: engine work that lands there runs one thread
at a time and delays the launch of step N+1's forward (on a GPU, the device waits for
it). Once the forward is under way (its kernels, a graph replay and the device-to-host
wait release the lock) the engine's work overlaps it instead. So the engine thread waits
for this signal, step N+1's inputs staged, before its own work for step N.

A model runner calls :func:`mark_inputs_staged` just before its forward; a runner that
does not is treated as staging when its ``execute_model`` returns (or raises), so the
engine never waits longer than the worker's ``execute_model``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_worker = threading.local()  # the signal of the step the worker thread is running


def mark_inputs_staged() -> None:
    """Called by a model runner on the worker thread once the step's inputs are staged
    (just before the forward). Does nothing outside a signalled step (a blocking call,
    a worker in its own process)."""
    signal: InputsStaged | None = getattr(_worker, "signal", None)
    if signal is not None:
        signal.release()


class InputsStaged:
    """One step's signal: set by the worker, waited for by the engine thread.

    A one-shot signal made of one lock, held from the start and released once when set:
    waiting is one acquire (a C call that gives up the interpreter lock) and setting one
    release. A ``threading.Event`` makes a condition and its lock per step, and its wait
    and set are Python code around them that runs on every step of every async
    hand-off."""

    __slots__ = ("_lock", "_unset")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        # One token: the first setter takes it (``list.pop`` is atomic), later sets (the
        # runner's mark, the call's end, the future's callback) find none and do nothing.
        self._unset = [True]

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the worker thread with this signal armed for
        :func:`mark_inputs_staged`; set when it returns or raises, whatever it did."""
        _worker.signal = self
        try:
            return fn(*args, **kwargs)
        finally:
            _worker.signal = None
            self.release()

    def release(self, _: object = None) -> None:
        """Set the signal (also as a future's done callback); once set, it stays set."""
        try:
            self._unset.pop()
        except IndexError:
            return  # set already
        self._lock.release()

    def is_set(self) -> bool:
        return not self._unset

    def wait(self) -> None:
        """Block until the step's inputs are staged (or its ``execute_model`` ended, or
        will never run)."""
        if self._unset:
            with self._lock:  # released by the setter; released again for any later wait
                pass
