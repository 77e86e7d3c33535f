"""Data parallelism on a real two-node Ray cluster (two raylets on loopback).

``ray.cluster_utils.Cluster`` starts a head node and a second node, each a real raylet
with its own resources. Two replicas must land on different nodes (one placement group
each), answer greedy prompts exactly like transformers, take requests pinned by rank, and
survive the SIGKILL of the other replica, which is then restarted and serves again. With
the ``ray`` executor and TP=2 inside each replica, a replica's ranks sit in its own
placement group, on its node.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from enginecore import LLM, SamplingParams
from enginecore.errors import EngineDeadError
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3, "resources": {"head_node": 1}},
    )
    cluster.add_node(num_cpus=3, resources={"second_node": 1})  # logical CPUs
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_two_replicas_on_two_nodes_serve_and_survive_a_sigkill(tiny_llama, two_node_cluster):
    prompts = mixed_prompts(9)[:4]
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_blocks_override=128,
        max_model_len=512,
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_address=two_node_cluster.address,
    )
    try:
        engines = llm.engine_client.engines
        assert [e.engine_index for e in engines] == [0, 1]
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        assert {e.node_id for e in engines} == nodes, "one replica per node"
        assert "ray" in llm.engine_client.ready.components["data_parallel"]

        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert_matches_reference(
                out.outputs[0].token_ids, greedy_reference(tiny_llama, prompt, 6), "ray dp"
            )
        pinned = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, data_parallel_rank=1)
        assert pinned[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids

        # SIGKILL replica 1's engine process (the actor): only rank 1 is lost.
        killed_pid = engines[1].pid
        os.kill(killed_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="replica 1"):
            llm.generate(
                {"prompt_token_ids": prompts[1]},
                SamplingParams(max_tokens=400, ignore_eos=True),
                data_parallel_rank=1,
            )
        survivors = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)
        assert [o.outputs[0].token_ids for o in survivors] == [
            o.outputs[0].token_ids for o in outputs[:2]
        ]
        # Its node lives on: the replica is restarted (a new actor and placement group)
        # and takes pinned requests again.
        coordinator = llm.engine_client.coordinator
        deadline = time.monotonic() + 240
        while 1 in coordinator.dead:
            assert time.monotonic() < deadline, "replica 1 was not restarted"
            time.sleep(0.5)
        assert engines[1].pid != killed_pid
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, data_parallel_rank=1)
        assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    # Shutdown removes both replicas' placement groups (and disconnects from the cluster).
    assert not ray.is_initialized()
    ray.init(address=two_node_cluster.address)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_tp2_replicas_place_their_ranks_in_their_own_placement_group(tiny_llama, two_node_cluster):
    prompts = mixed_prompts(10)[:4]
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_blocks_override=128,
        max_model_len=512,
        data_parallel_size=2,
        data_parallel_backend="ray",
        ray_address=two_node_cluster.address,
        executor="ray",
        tensor_parallel_size=2,
    )
    try:
        engines = llm.engine_client.engines
        assert len({e.node_id for e in engines}) == 2
        groups = ray.util.placement_group_table()
        for engine in engines:
            group = groups[engine.placement_group.id.hex()]
            # bundle 0: the engine core; bundles 1 and 2: its two TP ranks
            assert group["state"] == "CREATED" and len(group["bundles"]) == 3
        live = [g for g in groups.values() if g["state"] != "REMOVED"]
        assert len(live) == 2, "the replicas' executors made no placement group of their own"
        # By name: a function would be pickled, and Ray replicas' sockets are TCP, where
        # only msgpack travels.
        rank_pids = llm.collective_rpc("get_pid")
        assert len(rank_pids) == 4 and len(set(rank_pids)) == 4
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert_matches_reference(
                out.outputs[0].token_ids, greedy_reference(tiny_llama, prompt, 6), "ray dp tp2"
            )
    finally:
        llm.shutdown()
