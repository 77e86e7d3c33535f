"""Fans each step's stats out to the selected stat loggers, in the frontend process.

Each logger's calls run on a thread of its own, each bounded by
``engine.frontend_plugin_timeout`` (:mod:`enginecore.frontend_plugin_calls`). A logger
that raises or does not return in time is named once (its plugin and the method) and
disabled; the others keep logging: a broken plugin never breaks or freezes serving.
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.engine.serial_thread import SerialThread
from enginecore.frontend_plugin_calls import PluginCallTimeout, call_bounded
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
        self._host = plugin_host
        self.timeout: float = config.engine.frontend_plugin_timeout
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
        self._threads: dict[int, SerialThread] = {}
        self.disabled: set[int] = set()  # positions of loggers that raised or hung

    def _call(self, position: int, method: str, *args: Any) -> None:
        """One logger's ``method(*args)``, bounded; a failure disables that logger."""
        if position in self.disabled:
            return
        call = getattr(self.loggers[position], method, None)
        if call is None:  # a duck-typed logger without the optional method
            return
        thread = self._threads.get(position)
        if thread is None:
            thread = self._threads[position] = SerialThread(
                f"enginecore-stat-logger-{self.names[position]}"
            )
        try:
            call_bounded(thread, call, args, self.timeout)
        except Exception as exc:
            self._disable(position, method, exc)

    def _disable(self, position: int, method: str, exc: Exception) -> None:
        self.disabled.add(position)
        name = self.names[position]
        try:
            provider, _ = describe_provider(self._host, "stat_logger", name)
        except Exception:  # an aggregate twin ("logging (all engines)") is not registered
            provider = f"stat logger {name!r}"
        cls = type(self.loggers[position]).__qualname__
        what = str(exc) if isinstance(exc, PluginCallTimeout) else "raised"
        logger.error(
            "%s %s in %s.%s; it is disabled, the other stat loggers keep logging",
            provider,
            what,
            cls,
            method,
            exc_info=None if isinstance(exc, PluginCallTimeout) else exc,
        )
        thread = self._threads.pop(position, None)
        if thread is not None:
            thread.shutdown(wait=False)

    def _call_all(self, method: str, *args: Any) -> None:
        for position in range(len(self.loggers)):
            self._call(position, method, *args)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        for position in range(len(self.loggers)):
            wanted = self.engines[position] if position < len(self.engines) else None
            if wanted is not None and wanted != engine_index:
                continue
            self._call(position, "record", scheduler_stats, iteration_stats, engine_index)

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
        for position, name in enumerate(self.names):
            if name in seen:
                continue
            seen.add(name)
            self._call(position, "record_admission_rejection", reason)

    def close(self) -> None:
        self._call_all("close")
        threads, self._threads = self._threads, {}
        for thread in threads.values():
            thread.shutdown(wait=False)


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
