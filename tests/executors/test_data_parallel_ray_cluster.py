"""Data parallelism across the nodes of a simulated Ray cluster, and the loss of a node.

Three raylets on one machine: the head (1 logical CPU, where the frontend runs), and
nodes b (127.0.0.2) and c (127.0.0.3) of 3 CPUs: room for one replica each (its engine
core plus a TP=2 ``ray`` executor). Two replicas must land on b and c, each with its TP
group on its own node, answer like one engine, and, when node c is SIGKILLed, fail only
the requests of the replica on it, with an error naming that replica, while the other
keeps serving; when node c comes back, the replica is restarted there (the only node with
room) and serves again, pinned and balanced (the coordinator's per-replica counts say
where requests went).
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="data parallelism on Ray needs enginecore[ray]")

from enginecore import LLM, SamplingParams  # noqa: E402
from enginecore.errors import EngineDeadError  # noqa: E402
from enginecore.testing.ray_cluster import SimulatedRayCluster  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _wait_restarted(llm: LLM, index: int, timeout: float) -> float:
    started = time.monotonic()
    while index in llm.engine_client.coordinator.dead:
        assert time.monotonic() - started < timeout, f"replica {index} was not restarted"
        time.sleep(0.5)
    return time.monotonic() - started


def test_replicas_on_two_nodes_survive_the_loss_of_one_and_its_return(tiny_llama) -> None:
    prompts = [{"prompt_token_ids": p} for p in ([11, 12, 13, 14], [300, 200, 100])]
    with LLM(tiny_llama, dtype="float32", num_blocks_override=64, max_model_len=256) as one:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    with SimulatedRayCluster([("head", 1), ("b", 3), ("c", 3)]) as cluster:
        llm = LLM(
            tiny_llama,
            dtype="float32",
            num_blocks_override=64,
            max_model_len=256,
            ready_timeout=240,
            data_parallel_size=2,
            data_parallel_backend="ray",
            executor="ray",
            tensor_parallel_size=2,
            ray_address=cluster.address,
        )
        try:
            placed = llm.collective_rpc("device_assignment")  # replica-major
            nodes = [a["node_ip"] for a in placed]
            assert nodes[0] == nodes[1] and nodes[2] == nodes[3], placed
            assert {nodes[0], nodes[2]} == {"127.0.0.2", "127.0.0.3"}, placed
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
            assert got == want
            on_c = 0 if nodes[0] == "127.0.0.3" else 1

            started = time.monotonic()
            cluster.kill_node("c")
            with pytest.raises(EngineDeadError, match=f"replica {on_c}"):
                llm.generate(prompts[0], SamplingParams(max_tokens=50), data_parallel_rank=on_c)
            assert time.monotonic() - started < 90, "the lost node was noticed in bounded time"
            survivors = llm.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in survivors] == want
            coordinator = llm.engine_client.coordinator
            assert list(coordinator.dead) == [on_c]
            served_before = list(coordinator.served)

            cluster.restart_node("c")
            _wait_restarted(llm, on_c, timeout=300)
            placed = llm.collective_rpc("device_assignment")
            nodes = [a["node_ip"] for a in placed]
            assert nodes[2 * on_c] == nodes[2 * on_c + 1] == "127.0.0.3", placed
            pinned = llm.generate(prompts[1], GREEDY, data_parallel_rank=on_c)
            assert pinned[0].outputs[0].token_ids == want[1]
            balanced = llm.generate(prompts * 2, GREEDY)
            assert [o.outputs[0].token_ids for o in balanced] == want * 2
            assert coordinator.served[on_c] >= served_before[on_c] + 2, coordinator.served
            assert coordinator.served[1 - on_c] > served_before[1 - on_c], coordinator.served
        finally:
            llm.shutdown()
    if ray.is_initialized():
        ray.shutdown()
