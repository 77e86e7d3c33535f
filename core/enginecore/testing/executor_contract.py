"""``ExecutorContract``: the behaviour every executor plugin owes the engine.

Subclass it in your own pytest tests and point it at your executor::

    from enginecore.testing import ExecutorContract

    class TestMyExecutor(ExecutorContract):
        executor = "my-executor"      # a registered name, or the class itself
        world_size = 2                # ranks to start (tensor_parallel_size)

The suite starts your executor with the real generic ``Worker`` and a stub model runner
(no weights, no forward pass), so it tests the executor alone: one result per rank in
rank order, ``unique_reply_rank``, args and kwargs, callables, calls applied in order, a
rank's exception coming back with its rank, a clear error for an unknown method,
``timeout``, ``non_block`` Futures, the ``execute_model``/``sample_tokens`` defaults,
and -- for executors whose ranks live in other processes -- the death chain: when a rank
is SIGKILLed, the failure callback fires naming the rank and in-flight calls fail, all
within a few seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, ClassVar

import msgspec
import pytest

from enginecore.interfaces import Executor, ModelRunner
from enginecore.runner_output import ModelRunnerOutput

STUB_RUNNER_REF = "enginecore.testing.executor_contract:StubModelRunner"


class StubModelRunner(ModelRunner):
    """A model runner with no model: enough for the Worker to start and answer calls."""

    def __init__(self, config: Any, worker_spec: Any, device: Any = None, parallel: Any = None):
        self.config, self.parallel = config, parallel
        self.calls: list[Any] = []

    def load_model(self) -> None:
        return None

    def determine_available_memory(self) -> int:
        return 1 << 20

    def get_kv_cache_block_bytes(self) -> int:
        return 1024

    def get_max_model_len(self) -> int:
        return 128

    def initialize_kv_cache(self, num_blocks: int) -> None:
        return None

    def execute_model(self, scheduler_output: Any) -> None:
        return None

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=["stub"], sampled_token_ids=[[7]])


# Functions sent to the ranks (module-level: they pickle by reference).


def rank_of(worker: Any) -> int:
    rank: int = worker.rank
    return rank


def echo_args(worker: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    return worker.rank, args, kwargs


def raise_on_rank(worker: Any, rank: int) -> int:
    if worker.rank == rank:
        raise ValueError(f"contract failure on purpose (rank {worker.rank})")
    own_rank: int = worker.rank
    return own_rank


def record(worker: Any, value: int) -> None:
    worker.__dict__.setdefault("_contract_log", []).append(value)


def read_log(worker: Any) -> list[int]:
    return list(worker.__dict__.get("_contract_log", []))


def sleep_for(worker: Any, seconds: float) -> int:
    time.sleep(seconds)
    rank: int = worker.rank
    return rank


def pid_of(worker: Any) -> int:
    return os.getpid()


class ExecutorContract:
    """Subclass and set ``executor`` (name or class) and ``world_size``."""

    executor: ClassVar[Any] = "uni"
    world_size: ClassVar[int] = 1
    #: flat config keys to set or override (``{"distributed_backend": "gloo"}``; a class
    #: given as ``executor`` gets ``executor = "uni"`` in its config unless set here)
    config_overrides: ClassVar[dict[str, Any]] = {}
    #: seconds the death chain may take (the engine promises 5)
    death_deadline_s: ClassVar[float] = 5.0

    # --- construction (override make_executor for unusual constructors) -------------------

    @classmethod
    def make_config(cls) -> Any:
        from enginecore.config import make_config

        name = cls.executor if isinstance(cls.executor, str) else "uni"
        flat: dict[str, Any] = {
            "model": "contract-stub-model",
            "executor": name,
            "tensor_parallel_size": cls.world_size,
            "num_blocks_override": 16,
        }
        flat.update(cls.config_overrides)
        return make_config(**flat)

    @classmethod
    def make_executor(cls) -> Any:
        from enginecore.engine.components import resolve_components
        from enginecore.plugins import make_plugin_manager

        config = cls.make_config()
        host = make_plugin_manager(config.plugins.enabled, config.plugins.disabled, strict=False)
        components = resolve_components(config, host)
        spec = msgspec.structs.replace(components.worker_spec, model_runner_ref=STUB_RUNNER_REF)
        executor_cls = components.executor_cls if isinstance(cls.executor, str) else cls.executor
        return executor_cls(config, spec)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_executor(cls) -> Any:
        executor = cls.make_executor()
        try:
            yield executor
        finally:
            executor.shutdown()

    # --- the contract ------------------------------------------------------------------------

    def test_one_result_per_rank_in_rank_order(self, contract_executor: Executor) -> None:
        assert contract_executor.collective_rpc(rank_of) == list(range(self.world_size))
        assert contract_executor.collective_rpc("get_rank") == list(range(self.world_size))

    def test_unique_reply_rank_returns_that_ranks_result_alone(
        self, contract_executor: Executor
    ) -> None:
        last = self.world_size - 1
        assert contract_executor.collective_rpc(rank_of, unique_reply_rank=last) == last

    def test_unique_reply_rank_outside_the_world_is_refused(
        self, contract_executor: Executor
    ) -> None:
        for rank in (-1, self.world_size):
            with pytest.raises(ValueError, match=f"unique_reply_rank {rank} is outside"):
                contract_executor.collective_rpc(rank_of, unique_reply_rank=rank)
        assert contract_executor.collective_rpc(rank_of) == list(range(self.world_size))

    def test_args_and_kwargs_reach_every_rank(self, contract_executor: Executor) -> None:
        got = contract_executor.collective_rpc(echo_args, args=(1, "two"), kwargs={"k": [3]})
        assert got == [(r, (1, "two"), {"k": [3]}) for r in range(self.world_size)]
        assert (
            contract_executor.collective_rpc(lambda w, x: x * 2, args=(21,))
            == [42] * self.world_size
        )

    def test_a_ranks_exception_comes_back_with_its_rank(self, contract_executor: Executor) -> None:
        last = self.world_size - 1
        with pytest.raises(Exception, match=rf"rank {last}\b") as info:
            contract_executor.collective_rpc(raise_on_rank, args=(last,))
        assert "contract failure on purpose" in str(info.value)
        assert getattr(info.value, "rank", last) == last
        # The executor stays usable.
        assert contract_executor.collective_rpc(rank_of) == list(range(self.world_size))

    def test_unknown_method_is_a_clear_error(self, contract_executor: Executor) -> None:
        with pytest.raises(Exception, match="no_such_worker_method"):
            contract_executor.collective_rpc("no_such_worker_method")
        assert contract_executor.collective_rpc(rank_of) == list(range(self.world_size))

    def test_non_block_returns_a_future(self, contract_executor: Executor) -> None:
        future = contract_executor.collective_rpc(rank_of, non_block=True)
        assert isinstance(future, Future)
        assert future.result(timeout=30) == list(range(self.world_size))

    def test_calls_are_applied_in_order(self, contract_executor: Executor) -> None:
        futures = [
            contract_executor.collective_rpc(record, args=(i,), non_block=True) for i in range(20)
        ]
        for f in futures:
            f.result(timeout=30)
        logs = contract_executor.collective_rpc(read_log)
        assert all(log[-20:] == list(range(20)) for log in logs)

    def test_timeout_is_honoured(self, contract_executor: Executor) -> None:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            contract_executor.collective_rpc(sleep_for, args=(1.5,), timeout=0.2)
        assert time.monotonic() - started < 1.4
        time.sleep(1.5)  # the slow call finishes; later calls are answered normally
        assert contract_executor.collective_rpc(rank_of) == list(range(self.world_size))

    def test_execute_model_and_sample_tokens_defaults(self, contract_executor: Executor) -> None:
        from enginecore.scheduler_output import SchedulerOutput

        execute = contract_executor.execute_model(SchedulerOutput(), non_block=True)
        sample = contract_executor.sample_tokens(None, non_block=True)
        assert isinstance(execute, Future) and isinstance(sample, Future)
        assert execute.result(timeout=30) is None
        assert sample.result(timeout=30).sampled_token_ids == [[7]]
        assert contract_executor.get_max_model_len() == 128
        assert len(contract_executor.determine_available_memory()) == self.world_size

    def test_failure_callback_fires_when_a_rank_dies(self) -> None:
        executor = self.make_executor()
        try:
            pids = executor.collective_rpc(pid_of)
            if all(pid == os.getpid() for pid in pids):
                pytest.skip("the ranks live in this process: no rank can die alone")
            messages: list[str] = []
            fired = threading.Event()

            def on_failure(message: str) -> None:
                messages.append(message)
                fired.set()

            executor.register_failure_callback(on_failure)
            victim = self.world_size - 1
            in_flight = executor.collective_rpc(sleep_for, args=(60.0,), non_block=True)
            time.sleep(0.2)
            started = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            assert fired.wait(self.death_deadline_s), "failure callback did not fire"
            with pytest.raises(Exception, match=rf"rank {victim}\b"):
                in_flight.result(timeout=self.death_deadline_s)
            assert time.monotonic() - started < self.death_deadline_s
            assert len(messages) == 1 and f"rank {victim}" in messages[0]
            with pytest.raises(Exception, match=rf"rank {victim}\b"):
                executor.collective_rpc(rank_of)
        finally:
            executor.shutdown()
