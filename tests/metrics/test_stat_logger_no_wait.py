"""The step hands its stats to the stat loggers without waiting for them.

A logger's ``record`` runs on the logger's own thread; the step goes on at once. A slow
logger keeps a bounded number of records waiting and the rest are dropped and counted; a
logger that raised or hangs is noticed at its next call (or at ``flush``) and disabled,
named once, while the others keep recording.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from enginecore import LLM, SamplingParams, make_config
from enginecore.interfaces import IterationStats, StatLogger
from enginecore.metrics.logger_lane import MAX_PENDING_RECORDS
from enginecore.metrics.manager import StatLoggerManager
from enginecore.plugins import make_plugin_manager

SLOW_RECORD_S = 0.1
CONFIG = make_config(model="m", stat_loggers=[])


class TestLogger(StatLogger):
    """Built by the test itself, outside the plugin registry."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__(CONFIG)


class SlowLogger(TestLogger):
    """A metrics push that takes 100 ms (or ``delay``) per step."""

    def __init__(self, delay: float = SLOW_RECORD_S) -> None:
        super().__init__()
        self.delay = delay
        self.recorded = 0

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        time.sleep(self.delay)
        self.recorded += 1


class CountingLogger(TestLogger):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0
        self.records = 0
        self.step_times: list[float] = []  # when the frontend folded each step in

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        self.records += 1
        if iteration_stats is not None:
            self.tokens += iteration_stats.num_generation_tokens
            self.step_times.append(iteration_stats.timestamp)


class RaisingLogger(TestLogger):
    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        raise RuntimeError("metrics sink rejected the sample")


class HangingLogger(TestLogger):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        self.entered.set()
        self.release.wait()


def manager_with(*loggers: StatLogger, timeout: float = 30.0) -> StatLoggerManager:
    config = make_config(model="m", stat_loggers=[], frontend_plugin_timeout=timeout)
    manager = StatLoggerManager(config, make_plugin_manager(load_entrypoints=False))
    for position, stat_logger in enumerate(loggers):
        manager.loggers.append(stat_logger)
        manager.names.append(f"logger{position}")
        manager.engines.append(None)
    return manager


def step(manager: StatLoggerManager, tokens: int = 1) -> None:
    """One step's record, then the 1 ms an engine step waits for its outputs (the time a
    healthy logger's thread gets the interpreter)."""
    manager.record(None, IterationStats(num_generation_tokens=tokens))
    time.sleep(0.001)


def test_a_step_loop_does_not_wait_for_a_slow_logger(tiny_llama):
    steps = 60
    slow, counting = SlowLogger(), CountingLogger()
    with LLM(tiny_llama, max_model_len=256, num_blocks_override=32, stat_loggers=[]) as llm:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([[5, 6, 7]], warm, use_tqdm=False)  # kernels built on first use
        for name, stat_logger in (("slow", slow), ("counting", counting)):
            llm.stat_loggers.loggers.append(stat_logger)
            llm.stat_loggers.names.append(name)
            llm.stat_loggers.engines.append(None)
        greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        [out] = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == steps
    # Waiting on the slow logger every step would space the steps 100 ms apart at least;
    # the step loop takes a fraction of that.
    loop_s = counting.step_times[-1] - counting.step_times[0]
    assert loop_s < (steps - 1) * SLOW_RECORD_S / 3, loop_s
    # The fast logger saw every step; the slow one what it had time for, the rest counted.
    assert counting.tokens == steps
    assert 0 < slow.recorded < counting.records
    assert slow.recorded + llm.stat_loggers.dropped[0] == counting.records


def test_a_busy_logger_keeps_a_bounded_backlog_and_counts_the_rest(caplog):
    steps, delay = 3 * MAX_PENDING_RECORDS, 0.02
    slow, counting = SlowLogger(delay), CountingLogger()
    manager = manager_with(slow, counting)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="enginecore.metrics.manager"):
        for _ in range(steps):
            step(manager)
    assert time.monotonic() - started < steps * delay / 2
    manager.flush()
    assert counting.records == steps
    assert MAX_PENDING_RECORDS <= slow.recorded < steps
    assert slow.recorded + manager.dropped[0] == steps
    assert 1 not in manager.dropped
    busy = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert len(busy) == 1 and "'logger0'" in busy[0], busy  # warned once, not per record
    assert manager.disabled == set()  # slow is not broken
    manager.close()


def test_a_raising_logger_is_disabled_at_its_next_call_and_named_once(caplog):
    counting = CountingLogger()
    manager = manager_with(RaisingLogger(), counting)
    with caplog.at_level(logging.ERROR, logger="enginecore.metrics.manager"):
        step(manager)
        manager.flush()  # the failure is noticed here (or at the next record)
        for _ in range(5):
            step(manager)
        manager.flush()
    assert manager.disabled == {0}
    assert counting.records == 6
    named = [r.getMessage() for r in caplog.records if "it is disabled" in r.getMessage()]
    assert len(named) == 1 and "RaisingLogger.record" in named[0], named


def test_a_hanging_logger_is_noticed_at_the_next_step_past_the_limit(caplog):
    hanging, counting = HangingLogger(), CountingLogger()
    manager = manager_with(hanging, counting, timeout=0.3)
    try:
        with caplog.at_level(logging.ERROR, logger="enginecore.metrics.manager"):
            step(manager)
            assert hanging.entered.wait(10)
            started = time.monotonic()
            step(manager)  # within the limit: handed over (queued), no wait
            assert time.monotonic() - started < 0.2
            assert manager.disabled == set()
            time.sleep(0.4)
            started = time.monotonic()
            step(manager)  # past the limit: noticed now, still without waiting
            assert time.monotonic() - started < 0.2
        assert manager.disabled == {0}
        named = [r.getMessage() for r in caplog.records if "it is disabled" in r.getMessage()]
        assert len(named) == 1, named
        assert (
            "did not return within 0.3 s (config key engine.frontend_plugin_timeout)" in (named[0])
        )
        assert "HangingLogger.record" in named[0]
        for _ in range(3):
            step(manager)
        manager.flush()
        assert counting.records == 6  # the other logger kept every step
    finally:
        hanging.release.set()
        manager.close()


@pytest.mark.parametrize("method", ["log", "close"])
def test_a_waited_call_comes_after_the_records_handed_over(method):
    calls: list[str] = []

    class Ordered(TestLogger):
        def record(self, scheduler_stats, iteration_stats, engine_index=0):
            time.sleep(0.01)
            calls.append("record")

        def log(self):
            calls.append("log")

        def close(self):
            calls.append("close")

    manager = manager_with(Ordered())
    for _ in range(3):
        step(manager)
    getattr(manager, method)()
    assert calls == ["record"] * 3 + [method]
    manager.close()
