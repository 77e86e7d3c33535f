"""TP x PP on a simulated Ray cluster whose three nodes share one address (three raylets
on 127.0.0.1): the placement check counts nodes by id, so TP=2 x PP=2 fits on the two
2-CPU nodes (it was refused as "the nodes hold 1 such stage(s)" when nodes were keyed by
address), and the engine generates what a single process generates."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray executor needs enginecore[ray]")

from enginecore import LLM, SamplingParams  # noqa: E402
from enginecore.testing.ray_cluster import SimulatedRayCluster  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
COMMON = dict(dtype="float32", num_blocks_override=128, max_model_len=512, ready_timeout=180)


def test_tp2_pp2_on_three_nodes_sharing_one_address(tiny_llama) -> None:
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 15]}, {"prompt_token_ids": [200, 300]}]
    with LLM(tiny_llama, multiprocessing=False, **COMMON) as single:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
    nodes = [("head", 1), ("b", 2), ("c", 2)]
    with SimulatedRayCluster(nodes, shared_address=True) as cluster:
        try:
            with LLM(
                tiny_llama,
                executor="ray",
                tensor_parallel_size=2,
                pipeline_parallel_size=2,
                multiprocessing=False,
                ray_address=cluster.address,
                **COMMON,
            ) as llm:
                alive = [n for n in ray.nodes() if n["Alive"]]
                assert len(alive) == 3
                # One address for all three (Ray may report the host's own for loopback).
                assert len({n["NodeManagerAddress"] for n in alive}) == 1, alive
                placed = llm.collective_rpc("device_assignment")
                assert [a["rank"] for a in placed] == [0, 1, 2, 3]
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
            assert got == want
        finally:
            if ray.is_initialized():
                ray.shutdown()
