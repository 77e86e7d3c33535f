"""How many torch threads a CPU worker runs, and the core the HTTP server keeps.

An OpenMP team that shares its cores with the HTTP server stalls whenever one of its
threads is preempted, so ``enginecore serve`` keeps one core for the frontend; offline
``LLM`` use keeps none.
"""

from __future__ import annotations

import os

import pytest
import torch

from enginecore import LLM
from enginecore.config import ParallelConfig, make_config
from enginecore.engine.components import pick_executor_name
from enginecore.interfaces import WorkerSpec
from enginecore.server.launch import server_config
from enginecore_executors.worker import Worker, cpu_threads_per_rank

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, CORES),
        ({"cpu_reserved_cores": 1}, max(1, CORES - 1)),
        ({"cpu_reserved_cores": CORES + 4}, 1),  # never below one thread
        ({"tensor_parallel_size": 2}, max(1, CORES // 2)),
        ({"tensor_parallel_size": 2, "cpu_reserved_cores": 1}, max(1, (CORES - 1) // 2)),
        ({"data_parallel_size": 2}, max(1, CORES // 2)),
        ({"data_parallel_size": 2, "data_parallel_backend": "ray"}, CORES),
    ],
)
def test_threads_per_rank(settings, expected) -> None:
    assert cpu_threads_per_rank(ParallelConfig(**settings)) == expected


def test_negative_reservation_is_rejected() -> None:
    with pytest.raises(ValueError, match="cpu_reserved_cores must be >= 0"):
        ParallelConfig(cpu_reserved_cores=-1)


def test_the_server_reserves_one_core_unless_told_otherwise() -> None:
    assert server_config(make_config(model="m")).parallel.cpu_reserved_cores == 1
    chosen = server_config(make_config(model="m", cpu_reserved_cores=0))
    assert chosen.parallel.cpu_reserved_cores == 0


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"device": "cpu"}, "uni"),  # offline LLM: the worker stays in the engine process
        ({"device": "cpu", "cpu_reserved_cores": 1}, "mp"),  # enginecore serve on CPU
        ({"device": "cuda", "cpu_reserved_cores": 1}, "uni"),
        ({"device": "cpu", "tensor_parallel_size": 2}, "mp"),
        ({"device": "cpu", "cpu_reserved_cores": 1, "executor": "uni"}, "uni"),  # as asked
    ],
)
def test_auto_executor_puts_a_serving_cpu_rank_in_its_own_process(settings, expected) -> None:
    assert pick_executor_name(make_config(model="m", **settings)) == expected


@pytest.fixture(scope="module")
def reserving_llm(tiny_llama):
    """One engine keeping a core, shared: each test leaves its threads as it found them."""
    with LLM(tiny_llama, dtype="float32", cpu_reserved_cores=1) as llm:
        yield llm


@pytest.mark.skipif(CORES < 2, reason="needs two cores to reserve one")
@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="OMP_NUM_THREADS overrides it")
def test_the_engine_process_runs_the_threads_it_was_given(reserving_llm) -> None:
    def torch_threads(worker) -> int:  # nested: sent by value to the engine process
        return torch.get_num_threads()

    assert reserving_llm.collective_rpc(torch_threads) == [CORES - 1]
    assert reserving_llm.generate(["hello"])[0].outputs[0].token_ids  # and it still generates


@pytest.mark.skipif(CORES < 2, reason="needs two cores to reserve one")
@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="OMP_NUM_THREADS overrides it")
def test_large_prefill_steps_borrow_the_reserved_cores(reserving_llm, tiny_llama) -> None:
    def threads_per_step(worker) -> list[int]:  # nested: sent by value to the worker
        from types import SimpleNamespace

        from enginecore_executors.worker import BURST_MIN_PREFILL_TOKENS

        seen = []
        for scheduled in (
            {"a": BURST_MIN_PREFILL_TOKENS},  # one long prompt chunk
            {"a": 1, "b": 1, "c": BURST_MIN_PREFILL_TOKENS - 1},  # decodes and a short one
            {"a": BURST_MIN_PREFILL_TOKENS // 2, "b": BURST_MIN_PREFILL_TOKENS // 2},
            {"a": 1},
        ):
            worker._set_step_threads(SimpleNamespace(num_scheduled_tokens=scheduled))
            seen.append(torch.get_num_threads())
        return seen

    llm = reserving_llm
    assert llm.collective_rpc(threads_per_step) == [[CORES, CORES - 1, CORES, CORES - 1]]
    assert llm.generate(["hello"])[0].outputs[0].token_ids
    assert llm.collective_rpc(lambda worker: torch.get_num_threads()) == [CORES - 1]

    # Nothing to borrow: the same worker's device set-up in this process, keeping no core
    # (no model to load for it).
    spec = WorkerSpec(worker_ref="", model_runner_ref="", model_refs={})
    config = make_config(model=str(tiny_llama), dtype="float32", cpu_reserved_cores=0)
    worker = Worker(config, spec)
    worker.init_device()
    assert (worker.step_threads, worker.burst_threads) == (0, 0)
    assert torch.get_num_threads() == CORES
