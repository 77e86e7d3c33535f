"""The ``logging`` stat logger: one human-readable line every ``log_stats_interval``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from enginecore.interfaces import IterationStats, StatLogger
from enginecore.protocol import SchedulerStats

if TYPE_CHECKING:
    from enginecore.config import EngineConfig

logger = logging.getLogger("enginecore.metrics")


class LoggingStatLogger(StatLogger):
    """Accumulates every step's stats and logs averages over the interval since the last line.

    A line looks like::

        Engine 000: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput:
        2.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%,
        Prefix cache hit rate: 40.0%

    With speculative decoding it ends with ``Spec decode: draft acceptance rate: 62.5%,
    mean accepted length: 3.50`` (accepted / verified drafts, and 1 + accepted per
    verifying step) over the interval, when the interval verified any drafts.

    Throughputs and the prefix-cache hit rate cover the interval since the previous line;
    queue sizes and KV cache usage are the latest step's. The line is logged at INFO
    while the engine has work (or had some in the interval) and at DEBUG when idle, so an
    idle server does not fill its log.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, engine_index)
        self._clock = clock
        self._last_log_time = clock()
        self.last_scheduler_stats = SchedulerStats()
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.num_finished_requests = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
            self.num_finished_requests += len(iteration_stats.finished_requests)
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.prefix_cache_queries += scheduler_stats.prefix_cache_queries
            self.prefix_cache_hits += scheduler_stats.prefix_cache_hits
            self.num_preemptions += scheduler_stats.num_preemptions
            self.spec_num_drafts += scheduler_stats.spec_num_drafts
            self.spec_num_draft_tokens += scheduler_stats.spec_num_draft_tokens
            self.spec_num_accepted_tokens += scheduler_stats.spec_num_accepted_tokens

    @classmethod
    def aggregate_over_engines(cls, config: EngineConfig, engine_indexes: list[int]) -> StatLogger:
        """With data parallelism, the twin that writes one line for every replica."""
        from enginecore_stat_loggers.aggregate_logger import AggregatedLoggingStatLogger

        return AggregatedLoggingStatLogger(config, engine_indexes)

    def label(self) -> str:
        """What the line is about (the aggregate logger names every engine)."""
        return f"Engine {self.engine_index:03d}"

    def format_line(self, now: float | None = None) -> str:
        """The line :meth:`log` would write now (without resetting the interval)."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self.last_scheduler_stats
        hit_rate = (
            100.0 * self.prefix_cache_hits / self.prefix_cache_queries
            if self.prefix_cache_queries
            else 0.0
        )
        line = (
            f"{self.label()}: "
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, "
            f"Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if self.num_preemptions:
            line += f", Preemptions: {self.num_preemptions}"
        if self.spec_num_draft_tokens:
            line += (
                ", Spec decode: draft acceptance rate: "
                f"{100.0 * self.spec_num_accepted_tokens / self.spec_num_draft_tokens:.1f}%, "
                "mean accepted length: "
                f"{1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts:.2f}"
            )
        return line

    def log(self) -> None:
        now = self._clock()
        stats = self.last_scheduler_stats
        active = bool(
            self.num_prompt_tokens
            or self.num_generation_tokens
            or self.num_finished_requests
            or stats.num_running_reqs
            or stats.num_waiting_reqs
        )
        logger.log(logging.INFO if active else logging.DEBUG, "%s", self.format_line(now))
        self._reset_interval()
        self._last_log_time = now

    def log_engine_initialized(self) -> None:
        logger.info(
            "Engine %03d: logging stats every %.1f s",
            self.engine_index,
            self.config.observability.log_stats_interval,
        )
