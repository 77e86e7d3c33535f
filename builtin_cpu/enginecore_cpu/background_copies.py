"""Work that speeds later steps up, done on a thread of its own after the model is ready.

The ``gguf`` linear method computes prefill on a float32 copy of a layer's weights where
memory allows. Making the copies at load held the engine's start up for most of its load
time (a 1.7B model's quarter of free memory is tens of seconds of de-quantizing), and
making each on the first step that needed it made the first request the slowest. Here
they are made one job at a time on a low-priority thread: until a layer's copy is
published, its steps compute on the blocks as they would without the copy, and the same
results come out either way.

A job publishes its result with a single attribute assignment, which a step on another
thread sees either before or after, never halfway.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

_LOWEST_PRIORITY = 19  # nice value: steps on the engine's threads come first
_running: weakref.WeakSet[BackgroundJobs] = weakref.WeakSet()


class BackgroundJobs:
    """A queue of jobs run in order on one daemon thread, started with the first job."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = 0  # jobs finished (or failed), for callers that wait by count
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._gate = threading.Lock()  # held while paused; each job takes it
        self._finished = threading.Condition()
        self._submitted = 0
        self._stopping = False

    def submit(self, job: Callable[[], None]) -> None:
        self._submitted += 1
        self._queue.put(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
            _running.add(self)

    def stop(self) -> None:
        """Skip the jobs not started and wait for the running one: a thread still inside
        torch when the interpreter exits aborts the process."""
        self._stopping = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    @property
    def pending(self) -> int:
        return self._submitted - self.done

    def pause(self) -> None:
        """No job starts until :meth:`resume` (a running one finishes first)."""
        self._gate.acquire()

    def resume(self) -> None:
        self._gate.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far is done; returns whether they are."""
        with self._finished:
            return self._finished.wait_for(lambda: self.pending == 0, timeout)

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: normal priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if not self._stopping:
                    with self._gate:
                        job()
            except Exception:  # a failed copy only leaves a layer on its blocks
                logger.exception("%s: a background job failed", self.name)
            with self._finished:
                self.done += 1
                self._finished.notify_all()


@atexit.register
def _stop_all() -> None:
    for jobs in list(_running):
        jobs.stop()
