"""Where ranks go: each local data-parallel replica's own devices and cores, and the Ray
executor's check of a requested shape against the cluster's nodes (no Ray needed)."""

from __future__ import annotations

import pytest

from enginecore.config import ParallelConfig
from enginecore.distributed import REPLICA_ENV, replica_env
from enginecore.errors import ConfigError, EngineCoreError
from enginecore.placement import check_replicas_fit, check_shape_fits, groups_that_fit
from enginecore_executors.devices import (
    accelerator_index,
    check_accelerator_index,
    replica_cpu_cores,
)
from enginecore_executors.ray_placement import order_stages_by_node


def test_each_local_replica_owns_its_own_accelerators() -> None:
    par = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    owned = {(r, lr): accelerator_index(par, lr, r) for r in range(2) for lr in range(2)}
    assert owned == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    check_accelerator_index(par, 3, visible=4, replica=1)
    with pytest.raises(EngineCoreError, match=r"replica 1 needs accelerator 2.*sees 2.*= 4 dev"):
        check_accelerator_index(par, 2, visible=2, replica=1)


def test_only_local_replicas_get_an_index_in_their_environment() -> None:
    assert replica_env(ParallelConfig(data_parallel_size=2), 1) == {REPLICA_ENV: "1"}
    assert replica_env(ParallelConfig(), 0) == {}
    assert replica_env(ParallelConfig(data_parallel_size=2, data_parallel_backend="ray"), 1) == {}


@pytest.mark.parametrize(
    ("cores", "dp", "tp", "want"),
    [
        ([0, 1], 2, 1, [[0], [1]]),
        ([3, 1, 2, 0], 2, 1, [[0, 1], [2, 3]]),
        (list(range(8)), 2, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (list(range(5)), 2, 1, [[0, 1], [2, 3]]),  # the odd core stays unpinned
        ([0], 2, 1, None),  # fewer cores than replicas: they must share
        ([0, 1, 2, 3], 1, 2, None),  # one replica: nothing to split
    ],
)
def test_local_replicas_get_disjoint_core_sets(cores, dp, tp, want) -> None:
    par = ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp)
    got = [replica_cpu_cores(cores, par, r) for r in range(dp)]
    assert got == (want if want is not None else [None] * dp)


def _node(
    ip: str, cpus: float, gpus: float = 0.0, alive: bool = True, node_id: str | None = None
) -> dict:
    return {
        "NodeID": node_id or f"id-{ip}",
        "NodeManagerAddress": ip,
        "Alive": alive,
        "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})},
    }


def test_groups_that_fit_counts_whole_tp_groups() -> None:
    assert groups_that_fit({"CPU": 4.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}) == 1
    assert groups_that_fit({"CPU": 3.0}, {"CPU": 2.0}) == 1
    assert groups_that_fit({"CPU": 8.0}, {"CPU": 2.0, "GPU": 2.0}) == 0


def test_a_shape_that_fits_passes() -> None:
    nodes = [_node("127.0.0.1", 2), _node("127.0.0.2", 2)]
    check_shape_fits(nodes, {"CPU": 1.0}, tp=2, pp=2)


def test_nodes_sharing_one_address_count_as_separate_nodes() -> None:
    """Several raylets on one host report the same address: each is still a node."""
    nodes = [_node("127.0.0.1", cpus, node_id=f"node-{i}") for i, cpus in enumerate((1, 2, 2))]
    check_shape_fits(nodes, {"CPU": 1.0}, tp=2, pp=2)
    with pytest.raises(ConfigError, match=r"hold 2 such stage\(s\) in all"):
        check_shape_fits(nodes, {"CPU": 1.0}, tp=2, pp=3)


def test_a_tp_group_larger_than_any_node_names_the_node_shortfall() -> None:
    nodes = [_node("127.0.0.1", 2), _node("127.0.0.2", 2)]  # 4 CPUs in all, 2 per node
    with pytest.raises(ConfigError) as info:
        check_shape_fits(nodes, {"CPU": 1.0}, tp=4, pp=1)
    text = str(info.value)
    assert "tensor_parallel_size=4" in text and "CPU: 4 on a single node" in text
    assert "127.0.0.1: CPU: 2" in text and "127.0.0.2: CPU: 2" in text


def test_too_many_stages_name_how_many_are_missing() -> None:
    nodes = [_node("127.0.0.1", 2), _node("127.0.0.2", 3), _node("127.0.0.3", 8, alive=False)]
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 .* hold 2 .* 1 more stage"):
        check_shape_fits(nodes, {"CPU": 1.0}, tp=2, pp=3)


def test_gpu_shapes_count_gpus_per_node() -> None:
    nodes = [_node("10.0.0.1", 64, gpus=4), _node("10.0.0.2", 64, gpus=4)]
    check_shape_fits(nodes, {"CPU": 1.0, "GPU": 1.0}, tp=4, pp=2)
    with pytest.raises(ConfigError, match=r"GPU: 8 on a single node"):
        check_shape_fits(nodes, {"CPU": 1.0, "GPU": 1.0}, tp=8, pp=1)


def test_stages_are_ordered_driver_node_first_then_by_address() -> None:
    stage_nodes = ["n-b", "n-a", "n-b", "n-c"]
    addresses = {"n-a": "10.0.0.1", "n-b": "10.0.0.2", "n-c": "10.0.0.3"}
    # the driver sits on n-c: its stage becomes stage 0; n-b's two stages stay adjacent
    assert order_stages_by_node(stage_nodes, "n-c", addresses) == [3, 1, 0, 2]
    assert order_stages_by_node(stage_nodes, None, addresses) == [1, 0, 2, 3]


def test_a_loopback_frontend_is_refused_when_replicas_sit_on_other_machines() -> None:
    from enginecore.engine.dp_ray import check_frontend_reachable

    # every node on this machine (loopback aliases, or this machine's own address): fine
    check_frontend_reachable("127.0.0.1", ["192.0.2.2", "127.0.0.2", "127.0.0.3"], "192.0.2.2")
    check_frontend_reachable("10.0.0.1", ["10.0.0.1", "10.0.0.2"], "10.0.0.1")
    with pytest.raises(
        ConfigError, match=r"data_parallel_host='127.0.0.1' .* 10\.0\.0\.2.*10\.0\.0\.1"
    ):
        check_frontend_reachable("127.0.0.1", ["10.0.0.1", "10.0.0.2"], "10.0.0.1")


def test_data_parallel_replicas_that_cannot_fit_are_named() -> None:
    nodes = [_node("127.0.0.1", 1), _node("127.0.0.2", 3), _node("127.0.0.3", 3)]
    replica = [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]  # engine core + TP=2 ranks
    check_replicas_fit(nodes, replica, replicas=2)
    with pytest.raises(
        ConfigError, match=r"data_parallel_size=3: each replica needs CPU: 3 .* hold 2"
    ):
        check_replicas_fit(nodes, replica, replicas=3)
