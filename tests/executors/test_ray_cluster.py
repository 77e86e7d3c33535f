"""The ``ray`` executor on a simulated three-node Ray cluster (one machine, three raylets).

The head node (1 logical CPU, where the driver runs) cannot hold a TP=2 group; nodes b
(127.0.0.2) and c (127.0.0.3) hold one each. TP=2 x PP=2 must put each TP group on one
node, the stages on different nodes, ranks ordered by node; generate what one rank
generates; answer each step with one Ray task per rank; refuse an impossible shape at once
naming what is missing; and, when node c is SIGKILLed mid-generation, fail what was in
flight with an error naming the dead rank, without hanging, and give its resources back.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the ray executor needs enginecore[ray]")

from enginecore import LLM, SamplingParams  # noqa: E402
from enginecore.errors import ConfigError, EngineDeadError  # noqa: E402
from enginecore.testing.ray_cluster import SimulatedRayCluster  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
COMMON = dict(dtype="float32", num_blocks_override=128, max_model_len=512, ready_timeout=180)


@pytest.fixture(scope="module")
def cluster():
    with SimulatedRayCluster([("head", 1), ("b", 2), ("c", 2)]) as simulated:
        yield simulated
    if ray.is_initialized():
        ray.shutdown()


def _assignments(llm: LLM) -> list[dict]:
    return llm.collective_rpc("device_assignment")


def test_an_impossible_shape_fails_at_once_naming_what_is_missing(tiny_llama, cluster) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        LLM(
            tiny_llama,
            executor="ray",
            tensor_parallel_size=4,
            multiprocessing=False,
            ray_address=cluster.address,
            **COMMON,
        )
    text = str(info.value)
    assert "tensor_parallel_size=4" in text and "CPU: 4 on a single node" in text
    assert "127.0.0.2: CPU: 2" in text and "127.0.0.3: CPU: 2" in text
    assert time.monotonic() - started < 60, "refused without waiting for resources"
    if ray.is_initialized():
        ray.shutdown()


def test_tp2_pp2_groups_stay_on_one_node_each_and_a_dead_node_is_reported(
    tiny_llama, cluster, monkeypatch
) -> None:
    prompts = [[11, 12, 13, 14, 15], [200, 300, 400]]
    with LLM(tiny_llama, multiprocessing=False, **COMMON) as single:
        want = [o.outputs[0].token_ids for o in single.generate(_ids(prompts), GREEDY)]

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # ray_address="auto" finds it
    llm = LLM(
        tiny_llama,
        executor="ray",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        multiprocessing=False,
        ray_address="auto",
        **COMMON,
    )
    try:
        placed = _assignments(llm)
        nodes = [a["node_ip"] for a in placed]
        # each TP group on one node, the two stages on two nodes, ordered by node address
        assert nodes == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"], placed
        assert [a["rank"] for a in placed] == [0, 1, 2, 3]

        executor = llm.engine_client.engine.executor
        before = ray.get([a.served.remote() for a in executor.actors])
        got = [o.outputs[0].token_ids for o in llm.generate(_ids(prompts), GREEDY)]
        after = ray.get([a.served.remote() for a in executor.actors])
        assert got == want
        steps = [a["step"] - b["step"] for a, b in zip(after, before, strict=True)]
        calls = [a["call"] - b["call"] for a, b in zip(after, before, strict=True)]
        assert steps[0] >= GREEDY.max_tokens, "every step went out as one Ray task"
        assert calls == [0, 0, 0, 0], "no step needed a second round"

        # Node c (stage 1) is lost mid-generation: what was in flight fails, naming a rank.
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        request = llm.engine_client.engine
        started = time.monotonic()
        import threading

        killer = threading.Timer(1.0, cluster.kill_node, args=("c",))
        killer.start()
        with pytest.raises(EngineDeadError, match=r"rank [23] \(pid \d+, node 127\.0\.0\.3\) died"):
            llm.generate(_ids(prompts), long)
        killer.join()
        assert time.monotonic() - started < 90, "the loss was noticed without hanging"
        assert request is llm.engine_client.engine
    finally:
        llm.shutdown()
        cluster.restart_node("c")
    # the executor's placement groups were given back
    if not ray.is_initialized():
        ray.init(address=cluster.address, log_to_driver=False)
    table = ray.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in table.values()), table
    ray.shutdown()


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]
