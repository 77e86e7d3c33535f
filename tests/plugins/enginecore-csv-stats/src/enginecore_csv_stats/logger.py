"""``CsvStatLogger``: one row per finished request, to the settings' ``path``."""

from __future__ import annotations

import csv
from typing import Any

import msgspec

from enginecore.interfaces import StatLogger

COLUMNS = ("request_id", "finish_reason", "num_prompt_tokens", "num_generation_tokens", "user")


class CsvSettings(msgspec.Struct, kw_only=True):
    """The ``[plugins.csv_stats]`` table."""

    path: str
    user_key: str = "user"


class CsvStatLogger(StatLogger):
    def __init__(self, config, engine_index: int = 0, *, settings: CsvSettings) -> None:
        super().__init__(config, engine_index)
        self.settings = settings
        self._file = open(settings.path, "w", newline="")  # noqa: SIM115 (closed in close())
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_index: int = 0) -> None:
        if iteration_stats is None:
            return
        for done in iteration_stats.finished_requests:
            user = (done.extra or {}).get(self.settings.user_key, "")
            self._writer.writerow(
                (
                    done.request_id,
                    done.finish_reason,
                    done.num_prompt_tokens,
                    done.num_generation_tokens,
                    user,
                )
            )

    def close(self) -> None:
        self._file.close()
