"""The step hands its stats to the stat loggers without waiting for them.

A logger's ``record`` runs on the logger's own thread; the step goes on at once. A slow
logger keeps a bounded number of records waiting and the rest are dropped and counted; a
logger that raised or hangs is noticed at its next call (or at ``flush``) and disabled,
named once, while the others keep recording.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from enginecore import LLM, SamplingParams, make_config
from enginecore.interfaces import IterationStats, StatLogger
from enginecore.metrics.logger_lane import MAX_PENDING_RECORDS, LoggerLane
from enginecore.metrics.manager import StatLoggerManager
from enginecore.plugins import make_plugin_manager

CONFIG = make_config(model="m", stat_loggers=[])


class TestLogger(StatLogger):
    """Built by the test itself, outside the plugin registry."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__(CONFIG)


class SlowLogger(TestLogger):
    """A metrics push that takes ``delay`` seconds per step."""

    def __init__(self, delay: float) -> None:
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

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        self.records += 1
        if iteration_stats is not None:
            self.tokens += iteration_stats.num_generation_tokens


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


class GatedLogger(TestLogger):
    """Its first record blocks until ``gate`` opens (a metrics push stalled for a while)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate
        self.recorded = 0

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        if self.recorded == 0:
            self.gate.wait(60)
        self.recorded += 1


class OpeningLogger(CountingLogger):
    """Opens ``gate`` once it has seen ``tokens`` generated tokens."""

    def __init__(self, gate: threading.Event, tokens: int) -> None:
        super().__init__()
        self.gate, self.wanted = gate, tokens

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        super().record(scheduler_stats, iteration_stats, engine_index)
        if self.tokens >= self.wanted:
            self.gate.set()


def test_a_step_loop_does_not_wait_for_a_stalled_logger(tiny_llama):
    """One logger's first record stalls until another logger has seen every step of the
    request: a step loop that waited for the first logger would never get there (it
    would wait out the 20 s limit and disable the stalled logger)."""
    steps = 60
    gate = threading.Event()
    stalled, opening = GatedLogger(gate), OpeningLogger(gate, steps)
    kwargs = dict(max_model_len=256, num_blocks_override=32, frontend_plugin_timeout=20)
    with LLM(tiny_llama, stat_loggers=[], **kwargs) as llm:
        for name, stat_logger in (("stalled", stalled), ("opening", opening)):
            llm.stat_loggers.loggers.append(stat_logger)
            llm.stat_loggers.names.append(name)
            llm.stat_loggers.engines.append(None)
        greedy = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        [out] = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == steps
        assert gate.is_set()  # the steps went on while the first record stalled
        assert llm.stat_loggers.disabled == set()
        # generate waited for the records handed over: the other logger saw every step;
        # the stalled one those that waited behind it, the rest dropped and counted.
        assert opening.tokens == steps
        dropped = llm.stat_loggers.dropped.get(0, 0)
        assert stalled.recorded + dropped == opening.records
        assert 0 < stalled.recorded <= MAX_PENDING_RECORDS + 1  # + the one that stalled


def test_a_busy_logger_keeps_a_bounded_backlog_and_counts_the_rest(caplog):
    steps, delay = 3 * MAX_PENDING_RECORDS, 0.02  # 0.1 s of steps, 1.9 s of records
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


def test_a_logger_without_close_runs_every_record_before_shutdown():
    slow = SlowLogger(0.01)
    assert not hasattr(slow, "close")
    manager = manager_with(slow)
    for _ in range(5):
        manager.record(None, IterationStats(num_generation_tokens=1))
    manager.close()
    assert slow.recorded == 5


def test_a_lane_whose_thread_takes_no_more_calls_is_not_waited_for_forever():
    """A logger thread that no longer runs (ended, or held by a shutting-down interpreter)
    fails the wait after the time limit instead of holding its caller for good."""
    lane = LoggerLane("stopped")
    lane.close()
    lane.thread.join(5)
    assert not lane.thread.is_alive()
    started = time.monotonic()
    failure = lane.wait(0.2)
    assert failure is not None and failure[0] == "flush"
    assert time.monotonic() - started < 5


def test_an_engine_dropped_without_shutdown_lets_the_interpreter_exit(tiny_llama, tmp_path):
    """An ``LLM`` left for the interpreter's exit to collect, with a stat logger: the exit
    does not wait on the logger's thread."""
    script = tmp_path / "dropped.py"
    script.write_text(
        "from enginecore import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, num_blocks_override=64, multiprocessing=False)\n"
        "llm.generate('hi', SamplingParams(max_tokens=2))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
