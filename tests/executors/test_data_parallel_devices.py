"""Each local data-parallel replica (backend ``mp``) owns its own devices and cores.

Replica ``i``'s ranks take accelerator ordinals ``i * world_size ..`` (on a GPU host,
``cuda:2`` and ``cuda:3`` for replica 1 at TP=2) and, on CPU, a core set no other replica
uses. Asked of the real worker processes through the ``device_assignment`` worker method.
"""

from __future__ import annotations

import os

import pytest

from enginecore import LLM

CORES = sorted(os.sched_getaffinity(0))
ARGS = dict(dtype="float32", num_blocks_override=64, max_model_len=256, device="cpu")


def _by_replica(assignments: list[dict]) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = {}
    for a in assignments:
        grouped.setdefault(a["replica"], []).append(a)
    return grouped


@pytest.mark.slow
def test_two_replicas_take_distinct_accelerators_and_cores(tiny_llama) -> None:
    with LLM(tiny_llama, data_parallel_size=2, **ARGS) as llm:
        placed = llm.collective_rpc("device_assignment")  # replica-major
    assert [a["replica"] for a in placed] == [0, 1]
    assert [a["accelerator_index"] for a in placed] == [0, 1]
    if len(CORES) >= 2:
        first, second = (set(a["cpu_cores"]) for a in placed)
        assert first and second and not first & second, placed
        assert first | second <= set(CORES)


@pytest.mark.slow
def test_tp2_replicas_give_each_rank_its_own_accelerator(tiny_llama) -> None:
    with LLM(tiny_llama, data_parallel_size=2, tensor_parallel_size=2, **ARGS) as llm:
        placed = llm.collective_rpc("device_assignment")
    assert [(a["replica"], a["rank"]) for a in placed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [a["accelerator_index"] for a in placed] == [0, 1, 2, 3]
    cores = _by_replica(placed)
    if len(CORES) >= 2:
        assert not set(cores[0][0]["cpu_cores"]) & set(cores[1][0]["cpu_cores"])
        # the ranks of one replica share its core set
        assert cores[0][0]["cpu_cores"] == cores[0][1]["cpu_cores"]
