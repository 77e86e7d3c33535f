"""Fans each step's stats out to the selected stat loggers, in the frontend process.

Each logger's calls run on a thread of its own (:class:`LoggerLane`). A step hands
``record`` over without waiting for it; a logger still busy with earlier records keeps
at most :data:`MAX_PENDING_RECORDS` of them waiting, and later ones are dropped and
counted (never queued without bound). A record that raised, or one still running past
``engine.frontend_plugin_timeout``, is noticed at the logger's next call or at
:meth:`StatLoggerManager.flush`. The other methods (``log``, ``close``...) are rare and
waited for, bounded by the same limit (:mod:`enginecore.frontend_plugin_calls`). A
logger that raises or does not return in time is named once (its plugin and the method)
and disabled; the others keep logging: a broken plugin never breaks, freezes or slows
serving.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from enginecore.frontend_plugin_calls import PluginCallTimeout, timed_out
from enginecore.interfaces import IterationStats, StatLogger
from enginecore.metrics.logger_lane import MAX_PENDING_RECORDS, LoggerLane
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
        self._lanes: dict[int, LoggerLane] = {}
        self.disabled: set[int] = set()  # positions of loggers that raised or hung
        #: Records dropped per logger position while it was busy with earlier ones.
        self.dropped: dict[int, int] = {}

    def _lane(self, position: int) -> LoggerLane | None:
        """The logger's lane, its earlier calls checked; None once it is disabled."""
        if position in self.disabled:
            return None
        lane = self._lanes.get(position)
        if lane is None:
            lane = self._lanes[position] = LoggerLane(
                f"enginecore-stat-logger-{self.names[position]}"
            )
            return lane
        failure = lane.failure(self.timeout)
        if failure is not None:
            self._disable(position, *failure)
            return None
        return lane

    def _submit(self, position: int, method: str, *args: Any) -> None:
        """One logger's ``method(*args)`` handed over without waiting."""
        call = getattr(self.loggers[position], method, None)
        if call is None:
            return
        lane = self._lane(position)
        if lane is None:
            return
        if not lane.submit(method, call, args):
            dropped = self.dropped.get(position, 0)
            self.dropped[position] = dropped + 1
            if dropped == 0:
                logger.warning(
                    "stat logger %r is busy with %d earlier records; further records "
                    "are dropped while it is (counted in StatLoggerManager.dropped)",
                    self.names[position],
                    MAX_PENDING_RECORDS,
                )

    def _call(self, position: int, method: str, *args: Any) -> None:
        """One logger's ``method(*args)``, waited for after its earlier calls, bounded; a
        failure disables that logger."""
        call = getattr(self.loggers[position], method, None)
        if call is None:  # a duck-typed logger without the optional method
            return
        if not self._settle(position):
            return
        future = self._lanes[position].call(method, call, args)
        try:
            future.result(self.timeout)
        except FutureTimeout:
            self._disable(position, method, timed_out(self.timeout))
        except Exception as exc:
            self._disable(position, method, exc)

    def _settle(self, position: int) -> bool:
        """Wait for the logger's records handed over so far (each bounded); False once
        it is disabled."""
        lane = self._lane(position)
        if lane is None:
            return False
        failure = lane.wait(self.timeout)
        if failure is not None:
            self._disable(position, *failure)
            return False
        return True

    def flush(self) -> None:
        """Wait until every logger has run the records handed to it so far (bounded per
        record by ``engine.frontend_plugin_timeout``); a failure among them disables its
        logger. Read a logger's state after this, not while steps are in flight."""
        for position in range(len(self.loggers)):
            if position in self._lanes:
                self._settle(position)

    def _disable(self, position: int, method: str, exc: BaseException) -> None:
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
        lane = self._lanes.pop(position, None)
        if lane is not None:
            lane.close()

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
            self._submit(position, "record", scheduler_stats, iteration_stats, engine_index)

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
        if sys.is_finalizing():
            # The interpreter is going away (an engine dropped without shutdown): the
            # loggers' daemon threads can run nothing more, so nothing is waited for.
            return
        self.flush()  # a logger without ``close`` still runs the records handed to it
        self._call_all("close")
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            lane.close()


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
