"""A step's two halves (``execute_model``, then ``sample_tokens``) reach the ``uni``
executor's worker thread as one call (``Executor._launch_step``): one hand-off to the
worker and one back per step instead of two each. A subclass that defines its own halves,
a step with grammars (their bitmask is built while the forward runs) and an executor with
several ranks keep the two calls."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from enginecore import LLM, SamplingParams, make_config
from enginecore.engine.inputs_staged import InputsStaged, mark_inputs_staged
from enginecore.engine.overlap_choice import OverlapChoice
from enginecore.engine.serial_thread import SerialThread
from enginecore.errors import RankError
from enginecore_executors.uniproc import UniProcExecutor


class FakeWorker:
    """A worker whose halves record their order and can fail."""

    rank = 0

    def __init__(self, executed: Any = None, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.executed, self.fail = executed, fail

    def resolve_method(self, name: str) -> Any:
        return getattr(self, name)

    def execute_model(self, scheduler_output: Any) -> Any:
        self.calls.append("execute_model")
        mark_inputs_staged()
        if self.fail == "execute_model":
            raise ValueError("bad forward")
        return self.executed

    def sample_tokens(self, grammar_output: Any) -> Any:
        self.calls.append("sample_tokens")
        if self.fail == "sample_tokens":
            raise ValueError("bad sampling")
        return "sampled"


@pytest.fixture
def make_executor() -> Any:
    made: list[UniProcExecutor] = []

    def make(worker: FakeWorker) -> UniProcExecutor:
        executor = UniProcExecutor.__new__(UniProcExecutor)  # no model: a fake worker
        executor.config = make_config(model="fake")
        executor.worker = worker
        executor._thread = SerialThread("test-uni")
        executor.inputs_staged = None
        executor.__dict__["kv_output_aggregator"] = None  # one rank
        made.append(executor)
        return executor

    yield make
    for executor in made:
        executor._thread.shutdown()


def test_launch_step_runs_both_halves_as_one_call_with_the_step_s_output(
    make_executor: Any,
) -> None:
    worker = FakeWorker()
    executor = make_executor(worker)
    execute, sample = executor._launch_step(object(), None)
    assert execute is sample, "two futures: two hand-offs to the worker"
    assert sample.result(10) == "sampled"
    assert worker.calls == ["execute_model", "sample_tokens"]
    assert isinstance(executor.inputs_staged, InputsStaged)
    assert executor.inputs_staged.is_set()
    # An execute_model that returns the output (it sampled itself) gives that output.
    worker = FakeWorker(executed="executed")
    execute, sample = make_executor(worker)._launch_step(object(), None)
    assert sample.result(10) == "executed"
    assert worker.calls == ["execute_model", "sample_tokens"]


@pytest.mark.parametrize("failing", ["execute_model", "sample_tokens"])
def test_a_half_that_raises_is_named_and_the_engine_is_released(
    make_executor: Any, failing: str
) -> None:
    worker = FakeWorker(fail=failing)
    executor = make_executor(worker)
    _, launched = executor._launch_step(object(), None)
    with pytest.raises(RankError, match=rf"rank 0 raised in {failing}"):
        launched.result(10)
    executor.inputs_staged.wait()  # set even though the call raised
    # A forward that failed is not sampled.
    expected = (
        ["execute_model"]
        if failing == "execute_model"
        else [
            "execute_model",
            "sample_tokens",
        ]
    )
    assert worker.calls == expected


def test_a_subclass_with_its_own_halves_gets_them_called(make_executor: Any) -> None:
    calls: list[str] = []

    class OwnHalves(UniProcExecutor):
        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            calls.append("own execute_model")
            future: Future[Any] = Future()
            future.set_result(None)
            return future

    worker = FakeWorker()
    executor = make_executor(worker)
    object.__setattr__(executor, "__class__", OwnHalves)  # the same object, its subclass
    execute, sample = executor._launch_step(object(), None)
    assert execute is not sample
    assert execute.result(10) is None and sample.result(10) == "sampled"
    assert calls == ["own execute_model"] and worker.calls == ["sample_tokens"]


def test_each_decode_step_hands_the_worker_one_call(
    async_tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: as many calls reach the worker thread as batches are launched,
    and the tokens are those of the synchronous halves (called one by one below)."""
    llm = async_tiny_llm
    engine = llm.engine_client.engine  # type: ignore[attr-defined]
    monkeypatch.setattr(engine, "overlap_choice", OverlapChoice(adaptive=False))
    executor = engine.executor
    submitted: list[str] = []
    submit = executor._thread.submit

    def counting_submit(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not executor._thread.thread:
            submitted.append(getattr(fn, "__qualname__", repr(fn)))
        return submit(fn, *args, **kwargs)

    launched: list[int] = []
    schedule = engine.scheduler.schedule

    def counting_schedule() -> Any:
        out = schedule()
        if out.total_num_scheduled_tokens:
            launched.append(out.total_num_scheduled_tokens)
        return out

    monkeypatch.setattr(executor._thread, "submit", counting_submit)
    monkeypatch.setattr(engine.scheduler, "schedule", counting_schedule)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    got = llm.generate(prompts, params)
    assert len(launched) >= 8
    assert len(submitted) == len(launched), (
        f"{len(submitted)} calls reached the worker for {len(launched)} steps: {submitted[:4]}"
    )
    monkeypatch.setattr(executor._thread, "submit", submit)
    monkeypatch.setattr(engine, "_launch", _two_calls(engine))
    reference = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]


def _two_calls(engine: Any) -> Any:
    """The engine's launch as two separate calls (the way before ``_launch_step``)."""

    def launch(scheduler_output: Any) -> tuple[Future[Any], Future[Any]]:
        execute = engine.executor.execute_model(scheduler_output, non_block=True)
        sample = engine.executor.sample_tokens(None, non_block=True)
        return execute, sample

    return launch
