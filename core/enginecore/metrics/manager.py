"""Fans each step's stats out to the selected stat loggers, in the frontend process.

A logger that raises is reported once and then skipped for that call: a broken plugin
never breaks serving.
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.interfaces import IterationStats, StatLogger
from enginecore.protocol import SchedulerStats
from enginecore.startup_errors import ComponentStartupError, build_component, describe_provider

logger = logging.getLogger(__name__)


class StatLoggerManager:
    """Builds ``observability.stat_loggers`` from the plugin host's ``stat_logger`` registry.

    With data parallelism every selected logger is built once per replica
    (``cls(config, engine_index)``) and gets only that replica's stats; the ``logging``
    logger also gets an aggregate twin that sums every replica into one line.
    """

    def __init__(self, config: Any, plugin_host: Any, engine_index: int = 0) -> None:
        registry = plugin_host.registry("stat_logger")
        self.config = config
        self.loggers: list[StatLogger] = []
        self.names: list[str] = []
        self.engines: list[int | None] = []  # the replica each logger records; None: all
        size = config.parallel.data_parallel_size
        indexes = [engine_index] if size == 1 else list(range(size))
        for name in config.observability.stat_loggers:
            cls = registry.get(name)  # an unknown name raises, listing the known ones
            for index in indexes:
                stat_logger = build_component(plugin_host, "stat_logger", name, cls, config, index)
                _check_stat_logger(plugin_host, name, stat_logger)
                self.loggers.append(stat_logger)
                self.names.append(name)
                self.engines.append(index if size > 1 else None)
            # A logger class may offer one more logger that sums every replica (the
            # built-in ``logging`` writes one line for all engines this way).
            aggregate = getattr(cls, "aggregate_over_engines", None)
            if size > 1 and callable(aggregate):
                self.loggers.append(aggregate(config, indexes))
                self.names.append(f"{name} (all engines)")
                self.engines.append(None)
        self._warned: set[str] = set()

    def _call_all(self, method: str, *args: Any) -> None:
        for name, stat_logger in zip(self.names, self.loggers, strict=True):
            call = getattr(stat_logger, method, None)
            if call is None:  # a duck-typed logger without the optional method
                continue
            try:
                call(*args)
            except Exception:
                if f"{name}.{method}" not in self._warned:
                    self._warned.add(f"{name}.{method}")
                    logger.exception(
                        "stat logger %r raised in %s (further errors hidden)", name, method
                    )

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        for position, (name, stat_logger) in enumerate(zip(self.names, self.loggers, strict=True)):
            wanted = self.engines[position] if position < len(self.engines) else None
            if wanted is not None and wanted != engine_index:
                continue
            try:
                stat_logger.record(scheduler_stats, iteration_stats, engine_index)
            except Exception:
                if f"{name}.record" not in self._warned:
                    self._warned.add(f"{name}.record")
                    logger.exception(
                        "stat logger %r raised in record (further errors hidden)", name
                    )

    def log(self) -> None:
        self._call_all("log")

    def log_engine_initialized(self, ready: Any = None) -> None:
        """``ready`` (the engine's :class:`~enginecore.protocol.EngineCoreReadyResponse`)
        gives every logger the resolved context length and KV block count first (and the
        config the block size the engine chose, where it was left unset)."""
        if ready is not None:
            cache = getattr(self.config, "cache", None)
            if cache is not None and cache.block_size is None:
                cache.block_size = ready.block_size
            for stat_logger in self.loggers:
                stat_logger.max_model_len = ready.max_model_len
                stat_logger.num_kv_blocks = ready.num_blocks
        self._call_all("log_engine_initialized")

    def record_sleep_state(self, asleep: bool, level: int = 0) -> None:
        self._call_all("record_sleep_state", asleep, level)

    def record_admission_rejection(self, reason: str) -> None:
        # A rejection belongs to no replica: one call per selected logger name, so that
        # the per-replica copies of a logger do not count it once each.
        seen: set[str] = set()
        for name, stat_logger in zip(self.names, self.loggers, strict=True):
            call = getattr(stat_logger, "record_admission_rejection", None)
            if name in seen or call is None:
                continue
            seen.add(name)
            try:
                call(reason)
            except Exception:
                logger.exception("stat logger %r raised in record_admission_rejection", name)

    def close(self) -> None:
        for stat_logger in self.loggers:
            close = getattr(stat_logger, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    logger.exception("stat logger %r raised in close", stat_logger)


def _check_stat_logger(plugin_host: Any, name: str, stat_logger: Any) -> None:
    """A factory that builds something other than a stat logger fails now, not per step."""
    if isinstance(stat_logger, StatLogger) or callable(getattr(stat_logger, "record", None)):
        return
    provider, plugin = describe_provider(plugin_host, "stat_logger", name)
    raise ComponentStartupError(
        f"{provider} built a {type(stat_logger).__qualname__}, which is not a stat logger: "
        "subclass enginecore.interfaces.StatLogger and implement record()",
        kind="stat_logger",
        name=name,
        plugin=plugin,
    )
