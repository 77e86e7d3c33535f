"""Recording the next N steps a worker runs: the SchedulerOutput and per-rank timings.

Installed on a worker by the ``trace_next_steps`` worker RPC; the worker hands every
``execute_model``/``sample_tokens`` to the tracer while one is installed, and the tracer
removes itself after N steps. One JSON line per step, written as the step ends, so the
file is readable while the engine runs.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec


def default_trace_path(rank: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"enginecore-trace-{stamp}-pid{os.getpid()}-rank{rank}.jsonl"
    return Path(tempfile.gettempdir()) / name


def to_jsonable(obj: Any) -> Any:
    """msgspec structs (as objects, even array-like ones), sets and enums to JSON types;
    anything opaque (a KV connector's metadata, a tensor) as its repr."""
    if isinstance(obj, msgspec.Struct):
        return {name: to_jsonable(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted(to_jsonable(v) for v in obj)
    return msgspec.to_builtins(obj, enc_hook=repr, str_keys=True)


#: Bounds on one trace: steps, and bytes (a step of a large batch is a long line).
MAX_TRACE_STEPS = 1000
MAX_TRACE_BYTES = 64 * 1024 * 1024


class StepTracer:
    """Writes one line per traced step::

    {"rank": 0, "step": 0, "step_id": 12, "scheduler_output": {...},
     "num_scheduled_tokens": 5, "execute_model_s": 0.0021, "sample_tokens_s": 0.0004,
     "started_at": 1764489600.12}
    """

    def __init__(self, worker: Any, num_steps: int, path: str | os.PathLike | None = None):
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"trace_next_steps needs a positive step count, got {num_steps!r}")
        self.worker = worker
        self.rank = int(getattr(worker, "rank", 0))
        self.num_steps = num_steps
        if path is None:
            self.path = default_trace_path(self.rank)
        else:
            # "{rank}" in a caller's path keeps the ranks' files apart.
            self.path = Path(str(path).format(rank=self.rank))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._pending: dict[str, Any] | None = None
        self._done = 0
        self._written = 0
        self._lock = threading.Lock()

    def execute_model(self, scheduler_output: Any) -> Any:
        self._flush_pending()  # a step whose sample_tokens never came (a non-last PP rank)
        started = time.time()
        t0 = time.perf_counter()
        result = self.worker.model_runner.execute_model(scheduler_output)
        self._pending = {
            "rank": self.rank,
            "step": self._done,
            "step_id": getattr(scheduler_output, "step_id", None),
            "num_scheduled_tokens": getattr(scheduler_output, "total_num_scheduled_tokens", 0),
            "scheduler_output": to_jsonable(scheduler_output),
            "execute_model_s": time.perf_counter() - t0,
            "sample_tokens_s": None,
            "started_at": started,
        }
        if result is not None:  # the runner sampled inside execute_model
            self._flush_pending()
        return result

    def sample_tokens(self, grammar_output: Any) -> Any:
        t0 = time.perf_counter()
        result = self.worker.model_runner.sample_tokens(grammar_output)
        if self._pending is not None:
            self._pending["sample_tokens_s"] = time.perf_counter() - t0
            self._flush_pending()
        return result

    def _flush_pending(self) -> None:
        with self._lock:
            line, self._pending = self._pending, None
            if line is None or self._file is None:
                return
            text = json.dumps(line) + "\n"
            if self._written + len(text) > MAX_TRACE_BYTES:
                self.close()  # the trace stops at its size bound
                return
            self._file.write(text)
            self._written += len(text)
            self._done += 1
            if self._done >= self.num_steps:
                self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if getattr(self.worker, "step_tracer", None) is self:
            self.worker.step_tracer = None
