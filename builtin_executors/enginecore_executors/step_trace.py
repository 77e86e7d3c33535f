"""Recording the next N steps a worker runs: the SchedulerOutput and per-rank timings.

Installed on a worker by the ``trace_next_steps`` worker RPC; the worker hands every
``execute_model``/``sample_tokens`` to the tracer while one is installed, and the tracer
removes itself after N steps. One JSON line per step, written as the step ends, so the
file is readable while the engine runs.

The RPC is reachable over the network (``/collective_rpc``), so nothing about where the
trace goes comes from the caller: files are created, owner-only (0600, never following
a link), in the directory fixed at start-up (``observability.trace_dir``, an owner-only
directory), bounded in size (:data:`MAX_TRACE_BYTES`) and in number (the oldest beyond
:data:`MAX_TRACE_FILES` are removed). Prompt and output token ids and a request's
free-form sampling fields are replaced by their sizes unless the operator asked for
them (``observability.trace_prompt_contents``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from enginecore.runner_output import ModelRunnerOutput
    from enginecore.scheduler_output import GrammarOutput, SchedulerOutput

logger = logging.getLogger(__name__)
#: Bounds on the trace directory: files kept (the oldest go first).
MAX_TRACE_FILES = 32
_TRACE_GLOB = "enginecore-trace-*.jsonl"
_COUNTER = itertools.count()


def trace_directory(configured: str | None) -> Path:
    """The owner-only trace directory (created 0700); refuses one another user owns or
    others may write to."""
    if configured:
        directory = Path(configured).expanduser()
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = Path(cache) / "enginecore" / "traces"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"trace directory {directory} must belong to this user and be writable by no one else"
        )
    return directory


def _prune(directory: Path, keep: int) -> None:
    """Remove the oldest trace files beyond ``keep``."""
    files = []
    for path in directory.glob(_TRACE_GLOB):
        with contextlib.suppress(OSError):
            files.append((path.lstat().st_mtime, path))
    files.sort()
    for _, path in files[: max(len(files) - keep, 0)]:
        with contextlib.suppress(OSError):
            path.unlink()


def new_trace_file(directory: Path, rank: int) -> tuple[Path, Any]:
    """A fresh owner-only file in ``directory``: ``(path, text file open for writing)``."""
    _prune(directory, MAX_TRACE_FILES - 1)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"enginecore-trace-{stamp}-pid{os.getpid()}-rank{rank}-{next(_COUNTER)}.jsonl"
    path = directory / name
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    return path, os.fdopen(fd, "w", buffering=1, encoding="utf-8")


#: A new request's token ids, counted rather than kept without ``trace_prompt_contents``.
_CONTENT_FIELDS = ("prompt_token_ids", "output_token_ids")


def redact_contents(scheduler_output: dict[str, Any]) -> dict[str, Any]:
    """The JSON form of a SchedulerOutput with token ids replaced by their counts and a
    request's free-form sampling fields (stop strings, grammars, biases) by their sizes."""
    for new in scheduler_output.get("scheduled_new_reqs", []):
        for key in _CONTENT_FIELDS:
            if key in new:
                new[key] = {"redacted_count": len(new[key])}
        params = new.get("sampling_params")
        if isinstance(params, dict):
            for key, value in params.items():
                if isinstance(value, str | list | dict):
                    params[key] = {"redacted_size": len(json.dumps(value))}
    cached = scheduler_output.get("scheduled_cached_reqs")
    if isinstance(cached, dict) and "new_token_ids" in cached:
        cached["new_token_ids"] = [{"redacted_count": len(t)} for t in cached["new_token_ids"]]
    return scheduler_output


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

    def __init__(self, worker: Any, num_steps: int):
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ValueError(f"trace_next_steps needs a positive step count, got {num_steps!r}")
        self.worker = worker
        self.rank = int(getattr(worker, "rank", 0))
        self.num_steps = num_steps
        observability = getattr(getattr(worker, "config", None), "observability", None)
        self.contents = bool(getattr(observability, "trace_prompt_contents", False))
        directory = trace_directory(getattr(observability, "trace_dir", None))
        self.path, self._file = new_trace_file(directory, self.rank)
        self._pending: dict[str, Any] | None = None
        self._done = 0
        self._written = 0
        self._lock = threading.Lock()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._flush_pending()  # a step whose sample_tokens never came (a non-last PP rank)
        started = time.time()
        t0 = time.perf_counter()
        result: ModelRunnerOutput | None = self.worker.model_runner.execute_model(scheduler_output)
        self._pending = {
            "rank": self.rank,
            "step": self._done,
            "step_id": getattr(scheduler_output, "step_id", None),
            "num_scheduled_tokens": getattr(scheduler_output, "total_num_scheduled_tokens", 0),
            "scheduler_output": self._scheduler_output(scheduler_output),
            "execute_model_s": time.perf_counter() - t0,
            "sample_tokens_s": None,
            "started_at": started,
        }
        if result is not None:  # the runner sampled inside execute_model
            self._flush_pending()
        return result

    def _scheduler_output(self, scheduler_output: Any) -> Any:
        data = to_jsonable(scheduler_output)
        return data if self.contents or not isinstance(data, dict) else redact_contents(data)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        result: ModelRunnerOutput = self.worker.model_runner.sample_tokens(grammar_output)
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
            try:
                self._file.write(text)
            except OSError as exc:  # a full disk stops the trace, never the step
                self._give_up(exc)
                return
            self._written += len(text)
            self._done += 1
            if self._done >= self.num_steps:
                self.close()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()  # flushes: a full disk shows here
            except OSError as exc:
                self._give_up(exc)
        if getattr(self.worker, "step_tracer", None) is self:
            self.worker.step_tracer = None

    def _give_up(self, exc: OSError) -> None:
        logger.warning("step trace %s stopped, it cannot be written: %s", self.path, exc)
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        if getattr(self.worker, "step_tracer", None) is self:
            self.worker.step_tracer = None
