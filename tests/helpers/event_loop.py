"""One asyncio loop in a background thread for a module's AsyncLLM tests, and a stat logger that records."""

from __future__ import annotations

import asyncio
import threading

from enginecore.interfaces import StatLogger


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RecordingLogger(StatLogger):
    def __init__(self) -> None:
        self.records: list = []

    def record(self, scheduler_stats, iteration_stats, engine_index=0) -> None:
        self.records.append((scheduler_stats, iteration_stats))
