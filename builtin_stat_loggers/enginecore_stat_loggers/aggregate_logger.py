"""The aggregate twin of the ``logging`` stat logger for data parallelism: one line for
all replicas (token throughputs summed; running, waiting and preemptions summed over each
replica's latest step; KV cache usage averaged), beside each replica's own line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from enginecore.interfaces import IterationStats
from enginecore.protocol import SchedulerStats
from enginecore_stat_loggers.logging_logger import LoggingStatLogger, logger

if TYPE_CHECKING:
    from enginecore.config import EngineConfig


class AggregatedLoggingStatLogger(LoggingStatLogger):
    """Records every replica's stats; ``log()`` writes ``Engines 000-00N: ...``."""

    def __init__(self, config: EngineConfig, engine_indexes: list[int], **kwargs: Any) -> None:
        super().__init__(config, 0, **kwargs)
        self.engine_indexes = list(engine_indexes)
        self.latest: dict[int, SchedulerStats] = {}

    def label(self) -> str:
        return f"Engines {min(self.engine_indexes):03d}-{max(self.engine_indexes):03d}"

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        super().record(scheduler_stats, iteration_stats, engine_index)
        if scheduler_stats is None:
            return
        self.latest[engine_index] = scheduler_stats
        replicas = list(self.latest.values())
        self.last_scheduler_stats = SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in replicas),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in replicas),
            kv_cache_usage=sum(s.kv_cache_usage for s in replicas) / len(self.engine_indexes),
        )

    def log_engine_initialized(self) -> None:
        logger.info(
            "%s: one aggregate line for %d data-parallel engines every %.1f s",
            self.label(),
            len(self.engine_indexes),
            self.config.observability.log_stats_interval,
        )
