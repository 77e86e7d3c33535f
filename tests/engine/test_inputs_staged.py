"""With async scheduling the engine thread's work for batch N waits until the worker in
its process has staged batch N+1's inputs (``enginecore.engine.inputs_staged``).

Both threads need the interpreter lock: engine work that lands in the worker's input
preparation delays the next forward. The fast tests drive the signal on real threads;
the slow one runs an in-process engine whose runner takes visibly long to stage its
inputs, checks that no ``update_from_output`` overlaps a batch's input preparation while
updates do overlap the next batch's forward, and that the outputs, finish reasons and
order are those of synchronous scheduling."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

from enginecore import LLM, SamplingParams
from enginecore.engine import inputs_staged
from enginecore.engine.inputs_staged import InputsStaged, mark_inputs_staged
from enginecore.engine.overlap_choice import OverlapChoice
from enginecore.engine.serial_thread import SerialThread


@pytest.fixture
def worker_thread() -> Any:
    thread = SerialThread("test-worker")
    yield thread
    thread.shutdown()


def test_the_signal_is_set_where_the_runner_marks_its_inputs_staged(worker_thread) -> None:
    staged = InputsStaged()
    forward = threading.Event()

    def execute() -> str:
        mark_inputs_staged()
        forward.wait(10)  # the forward, still running when the engine goes on
        return "done"

    future = worker_thread.submit(staged.run, execute)
    staged.wait()
    assert not future.done()  # released before execute_model returned
    forward.set()
    assert future.result(10) == "done"


def test_a_runner_that_never_marks_releases_the_engine_when_it_returns_or_raises(
    worker_thread,
) -> None:
    staged, failing = InputsStaged(), InputsStaged()
    assert worker_thread.submit(staged.run, lambda: 7).result(10) == 7
    staged.wait()  # set at the end: no wait longer than execute_model

    def broken() -> None:
        raise ValueError("bad batch")

    future = worker_thread.submit(failing.run, broken)
    failing.wait()
    with pytest.raises(ValueError, match="bad batch"):
        future.result(10)


def test_marking_outside_a_signalled_step_sets_nothing(worker_thread) -> None:
    unrelated = InputsStaged()
    mark_inputs_staged()  # on this thread, in no step
    worker_thread.submit(mark_inputs_staged).result(10)  # a blocking call's runner
    assert not unrelated.is_set()
    # A step's signal is disarmed once its call ended: a later mark sets nothing.
    worker_thread.submit(unrelated.run, lambda: None).result(10)
    later = InputsStaged()
    worker_thread.submit(mark_inputs_staged).result(10)
    assert not later.is_set()


def test_the_signal_runs_no_python_threading_code(worker_thread) -> None:
    """Made, set and waited for once per async step: a lock's C calls, not an Event's
    condition and its Python code (the hand-off's instructions,
    ``benchmarks/handoff_instructions.py``)."""
    threading_calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == threading.__file__:
            threading_calls.append(frame.f_code.co_name)

    def execute() -> None:
        mark_inputs_staged()

    sys.setprofile(profile)
    try:
        staged = InputsStaged()
        staged.release()
        staged.wait()
        later = InputsStaged()
        later.run(execute)  # marked, then set again at the end: once is enough
        later.release()
        later.wait()
        later.wait()
    finally:
        sys.setprofile(None)
    assert threading_calls == []
    assert staged.is_set() and later.is_set()
    # Waiting before it is set still blocks until the worker sets it.
    pending = InputsStaged()
    assert not pending.is_set()
    worker_thread.submit(time.sleep, 0.05)
    worker_thread.submit(pending.release)
    pending.wait()
    assert pending.is_set()


PREP_SECONDS = 0.01  # the slow runner's input preparation, and again after its forward


class StepLog:
    """Intervals, on one clock: each batch's input preparation (``execute_model``'s start
    to its inputs staged), its forward (staged to ``execute_model``'s end) and each
    ``update_from_output``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prep: list[tuple[float, float]] = []
        self.forward: list[tuple[float, float]] = []
        self.updates: list[tuple[float, float]] = []
        self._prep_start = 0.0
        self._staged = 0.0

    def instrument(self, llm: LLM) -> None:
        engine = llm.engine_client.engine  # type: ignore[attr-defined]
        runner = engine.executor.worker.model_runner
        execute_model = runner.execute_model
        update = engine.scheduler.update_from_output

        def timed_execute(*args: Any) -> Any:
            self._prep_start = time.perf_counter()
            self._staged = 0.0
            try:
                return execute_model(*args)
            finally:
                if self._staged:
                    with self.lock:
                        self.forward.append((self._staged, time.perf_counter()))

        def slow(run_forward: Any) -> Any:
            def slow_forward(*args: Any, **kwargs: Any) -> Any:
                time.sleep(PREP_SECONDS)  # inputs take long to stage
                self._staged = time.perf_counter()
                with self.lock:
                    self.prep.append((self._prep_start, self._staged))
                out = run_forward(*args, **kwargs)  # marks the inputs staged first
                time.sleep(PREP_SECONDS)  # and a forward long enough to overlap
                return out

            return slow_forward

        def timed_update(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return update(*args)
            finally:
                with self.lock:
                    self.updates.append((start, time.perf_counter()))

        runner.execute_model = timed_execute
        # The layers' forward, and the CPU backend's fused decode step with its head.
        runner._run_forward = slow(runner._run_forward)
        runner._run_fused_head = slow(runner._run_fused_head)
        engine.scheduler.update_from_output = timed_update


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _params(stop_after: dict[int, int]) -> list[SamplingParams]:
    params = []
    for i in range(8):
        extra: dict[str, Any] = {}
        if i in stop_after:
            extra["stop_token_ids"] = [stop_after[i]]
        if i % 3 == 0:
            extra["min_tokens"] = 4
        params.append(
            SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=i % 2 == 0, **extra)
        )
    return params


def test_the_fused_step_with_its_head_marks_the_inputs_staged_before_it_runs(
    async_tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU backend's fused decode step with the LM head runs a step without the
    runner's ``_run_forward``; the signal must still be set before the call, not only when
    ``execute_model`` returns (the engine thread would then wait out the whole forward)."""
    calls: list[bool] = []
    llm = async_tiny_llm
    engine = llm.engine_client.engine  # type: ignore[attr-defined]
    monkeypatch.setattr(engine, "overlap_choice", OverlapChoice(adaptive=False))
    fused = engine.executor.worker.model_runner.fused_decode
    assert fused is not None and fused.has_head, "this CPU build should fuse the head"
    run = fused.run

    def recording_run(*args: Any, **kwargs: Any) -> Any:
        signal = getattr(inputs_staged._worker, "signal", None)
        if signal is not None and kwargs.get("head") is not None:
            calls.append(signal.is_set())
        return run(*args, **kwargs)

    monkeypatch.setattr(fused, "run", recording_run)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 3, params)
    assert len(calls) >= 4, f"the fused head ran in {len(calls)} signalled steps"
    assert all(calls), f"the fused head ran before its inputs were marked staged: {calls}"


def test_the_engine_s_work_waits_for_the_next_batch_s_staged_inputs(
    async_tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast sibling of the slow test below: the runner takes long to stage its inputs,
    and every ``update_from_output`` must find the inputs of the batch launched last
    already staged (were the engine not to wait, it would update during their staging)."""
    llm = async_tiny_llm
    engine = llm.engine_client.engine  # type: ignore[attr-defined]
    monkeypatch.setattr(engine, "overlap_choice", OverlapChoice(adaptive=False))
    runner = engine.executor.worker.model_runner
    execute_model, update = runner.execute_model, engine.scheduler.update_from_output
    staged_at_update: list[bool] = []

    def slow_staging(*args: Any) -> Any:
        time.sleep(PREP_SECONDS)  # the inputs take long to stage (the signal is armed)
        return execute_model(*args)

    def checked_update(*args: Any) -> Any:
        signal = engine.executor.inputs_staged
        staged_at_update.append(signal is not None and signal.is_set())
        return update(*args)

    monkeypatch.setattr(runner, "execute_model", slow_staging)
    monkeypatch.setattr(engine.scheduler, "update_from_output", checked_update)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    assert len(staged_at_update) >= 5 and engine.overlap_choice.counts[True] >= 5
    assert all(staged_at_update), (
        f"updates ran before the next inputs were staged: {staged_at_update}"
    )


@pytest.mark.slow
def test_the_engine_waits_for_the_next_batch_s_inputs_and_outputs_are_unchanged(
    tiny_llama,
) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 17, 29 + 2 * i, 41]} for i in range(8)]
    common = {"dtype": "float32", "multiprocessing": False, "max_model_len": 128}
    with LLM(tiny_llama, async_scheduling=False, **common) as llm:
        plain = llm.generate(prompts, _params({}))
    # A stop token each request meets midway (its sixth token), as sampled without it.
    stop_after = {i: out.outputs[0].token_ids[5] for i, out in enumerate(plain) if i % 4 == 1}
    with LLM(tiny_llama, async_scheduling=False, **common) as llm:
        reference = llm.generate(prompts, _params(stop_after))
    log = StepLog()
    with LLM(tiny_llama, async_scheduling=True, **common) as llm:
        log.instrument(llm)
        got = llm.generate(prompts, _params(stop_after))

    def summary(outputs: Any) -> list[tuple[list[int], str | None]]:
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]

    assert summary(got) == summary(reference)
    assert {o.outputs[0].finish_reason for o in reference} >= {"stop", "length"}
    assert len(log.updates) >= 10
    # No update ran while the worker prepared a batch's inputs ...
    clashes = [(u, p) for u in log.updates for p in log.prep if _overlaps(u, p)]
    assert not clashes, f"{len(clashes)} updates ran during input preparation"
    # ... and updates did run while the next batch was in flight (async scheduling).
    during_forward = [u for u in log.updates if any(_overlaps(u, f) for f in log.forward)]
    assert len(during_forward) >= len(log.updates) // 2
