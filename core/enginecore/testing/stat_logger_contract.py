"""``StatLoggerContract``: what the engine expects of a stat logger.

Subclass it and point it at your class::

    from enginecore.testing import StatLoggerContract

    class TestMyLogger(StatLoggerContract):
        stat_logger = "my-logger"     # a registered name, or the class

The engine builds a stat logger in the frontend as ``cls(config, engine_index)`` and then
calls ``log_engine_initialized()`` once, ``record(scheduler_stats, iteration_stats,
engine_index)`` once per step (either may be ``None``), and ``log()`` periodically --
from the output thread, so ``record`` must be cheap and never raise on odd but valid
input. Override :meth:`make_logger` if yours needs set-up (a temp path, an env var).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from enginecore.interfaces import IterationStats, StatLogger
from enginecore.protocol import SchedulerStats


def finished_request(request_id: str, **extra: Any) -> Any:
    from enginecore.metrics.stats import FinishedRequestStats
    from enginecore.request import FinishReason

    return FinishedRequestStats(
        request_id=request_id,
        finish_reason=str(FinishReason.STOP),
        num_prompt_tokens=7,
        num_generation_tokens=3,
        e2e_latency=0.5,
        ttft=0.1,
        extra=extra or None,
    )


def sample_steps() -> list[tuple[SchedulerStats | None, IterationStats | None]]:
    """Realistic and edge-case steps: a busy step, an idle one, missing halves."""
    return [
        (
            SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5),
            IterationStats(
                timestamp=1.0,
                num_prompt_tokens=12,
                num_generation_tokens=2,
                time_to_first_tokens=[0.05, 0.07],
            ),
        ),
        (
            SchedulerStats(num_running_reqs=1, prefix_cache_queries=16, prefix_cache_hits=8),
            IterationStats(
                timestamp=1.1,
                num_generation_tokens=1,
                inter_token_latencies=[0.01],
                finished_requests=[finished_request("r1", user="alice")],
            ),
        ),
        (SchedulerStats(), IterationStats(timestamp=1.2)),
        (None, IterationStats(timestamp=1.3, num_generation_tokens=1)),
        (SchedulerStats(num_preemptions=1), None),
        (None, None),
    ]


class StatLoggerContract:
    """Subclass and set ``stat_logger`` (a registered name or the class)."""

    stat_logger: ClassVar[str | type] = "logging"
    #: flat config keys to set
    config_overrides: ClassVar[dict[str, Any]] = {}

    def make_config(self) -> Any:
        from enginecore.config import make_config

        return make_config(**{"model": "contract-model", **self.config_overrides})

    def logger_class(self) -> type:
        if not isinstance(self.stat_logger, str):
            return self.stat_logger
        from enginecore.plugins import make_plugin_manager

        logger_class: type = (
            make_plugin_manager(strict=False).registry("stat_logger").get(self.stat_logger)
        )
        return logger_class

    def make_logger(self, engine_index: int = 0) -> StatLogger:
        """Build it the way the engine does; override to add set-up."""
        stat_logger: StatLogger = self.logger_class()(self.make_config(), engine_index)
        return stat_logger

    def close_logger(self, logger: StatLogger) -> None:
        """Release files or sockets; calls ``close()`` when the logger has one."""
        close = getattr(logger, "close", None)
        if callable(close):
            close()

    # --- the contract ------------------------------------------------------------------

    def test_is_a_stat_logger_built_from_config_and_engine_index(self) -> None:
        logger = self.make_logger(engine_index=3)
        try:
            assert isinstance(logger, StatLogger), "stat loggers subclass interfaces.StatLogger"
            assert logger.engine_index == 3, "call super().__init__(config, engine_index)"
            assert logger.config is not None
        finally:
            self.close_logger(logger)

    def test_full_lifecycle_accepts_every_kind_of_step(self) -> None:
        logger = self.make_logger()
        try:
            logger.log_engine_initialized()
            for scheduler_stats, iteration_stats in sample_steps():
                logger.record(scheduler_stats, iteration_stats, 0)
                logger.log()
            logger.log()  # twice in a row: an interval with nothing new
        finally:
            self.close_logger(logger)

    def test_record_accepts_positional_and_keyword_engine_index(self) -> None:
        logger = self.make_logger()
        try:
            stats, iteration = sample_steps()[0]
            logger.record(stats, iteration)
            logger.record(stats, iteration, engine_index=0)
            logger.record(scheduler_stats=stats, iteration_stats=iteration, engine_index=0)
        finally:
            self.close_logger(logger)

    def test_does_not_mutate_the_stats_it_receives(self) -> None:
        import copy

        logger = self.make_logger()
        try:
            for scheduler_stats, iteration_stats in sample_steps():
                before = (copy.deepcopy(scheduler_stats), copy.deepcopy(iteration_stats))
                logger.record(scheduler_stats, iteration_stats, 0)
                assert (scheduler_stats, iteration_stats) == before, (
                    "other stat loggers receive the same objects: record() must not change them"
                )
        finally:
            self.close_logger(logger)

    def test_two_engines_get_independent_loggers(self) -> None:
        first, second = self.make_logger(0), self.make_logger(1)
        try:
            assert first is not second
            assert (first.engine_index, second.engine_index) == (0, 1)
            for scheduler_stats, iteration_stats in sample_steps():
                first.record(scheduler_stats, iteration_stats, 0)
                second.record(scheduler_stats, iteration_stats, 1)
            first.log()
            second.log()
        finally:
            self.close_logger(first)
            self.close_logger(second)

    def test_record_is_safe_from_several_threads(self) -> None:
        """The output thread records while another thread may call ``log()``."""
        logger = self.make_logger()
        errors: list[BaseException] = []

        def hammer() -> None:
            try:
                for _ in range(50):
                    for scheduler_stats, iteration_stats in sample_steps():
                        logger.record(scheduler_stats, iteration_stats, 0)
                    logger.log()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, f"record()/log() raised from a thread: {errors[0]!r}"
        finally:
            self.close_logger(logger)
