"""``JsonlStatLogger``: appends one JSON object per engine step to a file.

The file is named by the plugin's settings table ``[plugins.jsonl_stats] path = ...``,
else by the environment variable ``ENGINECORE_JSONL_STATS_PATH`` (default
``./enginecore-stats.jsonl``), read when the logger is built. Lines are
appended and flushed one at a time, so ``tail -f`` shows each step as it happens and
several engine processes may share one file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading
import time
from typing import Any

import msgspec

from enginecore.interfaces import IterationStats, StatLogger

PATH_ENV_VAR = "ENGINECORE_JSONL_STATS_PATH"
DEFAULT_PATH = "./enginecore-stats.jsonl"


class JsonlSettings(msgspec.Struct, kw_only=True):
    """The ``[plugins.jsonl_stats]`` table (the plugin's ``plugin_settings``)."""

    path: str | None = None
    """File the lines are appended to (default: $ENGINECORE_JSONL_STATS_PATH, then
    ./enginecore-stats.jsonl)."""


def _finished_to_json(stats: Any) -> dict[str, Any]:
    if hasattr(stats, "to_dict"):
        return stats.to_dict()
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(vars(stats))


class JsonlStatLogger(StatLogger):
    """One line per :meth:`record` call (one engine step)::

        {"time": 1764489600.1, "engine": 0, "model": "m",
         "scheduler": {"num_running_reqs": 2, ...},
         "iteration": {"num_prompt_tokens": 12, "num_generation_tokens": 2,
                       "time_to_first_tokens": [...], "inter_token_latencies": [...]},
         "finished_requests": [{"request_id": "r1", "finish_reason": "stop", ...,
                                "extra": {"user": "alice"}}]}

    ``scheduler`` and ``iteration`` are ``null`` in a step that did not report them.
    """

    def __init__(
        self,
        config: Any,
        engine_index: int = 0,
        *,
        path: str | None = None,
        settings: JsonlSettings | None = None,
    ) -> None:
        super().__init__(config, engine_index)
        path = path or (settings.path if settings is not None else None)
        self.path = pathlib.Path(path or os.environ.get(PATH_ENV_VAR) or DEFAULT_PATH)
        self.model_name = config.model.served_model_name or config.model.path
        self._lock = threading.Lock()
        self._file: Any = None

    def _open(self) -> Any:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        return self._file

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        line: dict[str, Any] = {
            "time": time.time(),
            "engine": engine_index or self.engine_index,
            "model": self.model_name,
            "scheduler": (
                msgspec.structs.asdict(scheduler_stats) if scheduler_stats is not None else None
            ),
            "iteration": None,
            "finished_requests": [],
        }
        if iteration_stats is not None:
            line["iteration"] = {
                "num_prompt_tokens": iteration_stats.num_prompt_tokens,
                "num_generation_tokens": iteration_stats.num_generation_tokens,
                "time_to_first_tokens": list(iteration_stats.time_to_first_tokens),
                "inter_token_latencies": list(iteration_stats.inter_token_latencies),
            }
            line["finished_requests"] = [
                _finished_to_json(f) for f in iteration_stats.finished_requests
            ]
        # default=str: user metadata in ``extra`` may hold values JSON cannot encode.
        text = json.dumps(line, default=str)
        with self._lock:
            self._open().write(text + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __del__(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()
