"""The operator's command on a three-node Ray cluster (simulated on this machine):

    RAY_ADDRESS=<head> enginecore serve MODEL --executor ray --tensor-parallel-size 2 \\
        --data-parallel-size 2 --ray-address auto

Nodes b and c (3 CPUs each) hold one replica each: its engine core and both TP ranks on
one node (counted from the Ray processes each node runs). Killing node c fails the stream
it was serving with an error naming its replica, while the stream on b finishes and
``/health`` reports the dead replica; when node c returns, the replica is restarted there,
``/health`` is 200 again and both replicas serve (per-engine token counts in ``/metrics``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.serve_process import serve, stop
from tests.helpers.stats import generation_tokens_by_engine

pytest.importorskip("ray", reason="the ray executor needs enginecore[ray]")

from enginecore.testing.ray_cluster import SimulatedRayCluster

pytestmark = pytest.mark.slow


def ray_actors_by_node(cluster: SimulatedRayCluster, actor: str) -> dict[str, int]:
    """How many processes of one Ray actor class each node runs."""
    counts = {}
    for node in cluster.nodes:
        count = 0
        for pid in cluster.node_processes(node.name):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            count += cmdline.startswith(f"ray::{actor}".encode())
        counts[node.name] = count
    return counts


def wait_health(url: str, status: int, timeout: float) -> float:
    started = time.monotonic()
    while httpx.get(f"{url}/health", timeout=10).status_code != status:
        assert time.monotonic() - started < timeout, f"/health never answered {status}"
        time.sleep(0.5)
    return time.monotonic() - started


def test_serve_tp2_dp2_on_three_nodes_survives_a_node_and_gets_it_back(tiny_llama, tmp_path):
    with SimulatedRayCluster([("head", 1), ("b", 3), ("c", 3)]) as cluster:
        env = {**os.environ, **cluster.auth_env, "RAY_ADDRESS": cluster.address}
        env.pop("ENGINECORE_API_KEY", None)
        log_path = tmp_path / "server.log"
        flags = ["--executor", "ray", "--tensor-parallel-size", "2"]
        flags += ["--data-parallel-size", "2", "--ray-address", "auto"]
        flags += ["--dtype", "float32", "--max-model-len", "256", "--num-blocks-override", "64"]
        proc, url = serve(tiny_llama, log_path, *flags, "--ready-timeout", "300", env=env)
        try:
            assert "data_parallel=2 replicas (ray, internal load balancing)" in (
                log_path.read_text()
            )
            want = {"head": 0, "b": 2, "c": 2}
            assert ray_actors_by_node(cluster, "EngineCoreRankActor") == want
            assert ray_actors_by_node(cluster, "EngineCoreActor") == {"head": 0, "b": 1, "c": 1}
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id

            def complete(rank: int | None, max_tokens: int = 6):
                body = {"ignore_eos": True}
                if rank is not None:
                    body["data_parallel_rank"] = rank
                return client.completions.create(
                    model=model, prompt="the river bank", max_tokens=max_tokens,
                    temperature=0.0, extra_body=body,
                )  # fmt: skip

            expected = complete(0).choices[0].text
            assert complete(1).choices[0].text == expected

            # A long stream on each replica; node c dies under one of them.
            outcomes: dict[int, str] = {}
            first_chunk = {rank: threading.Event() for rank in (0, 1)}

            def stream(rank: int) -> None:
                try:
                    chunks = client.completions.create(
                        model=model, prompt="the river bank", max_tokens=200,
                        temperature=0.0, stream=True,
                        extra_body={"ignore_eos": True, "data_parallel_rank": rank},
                    )  # fmt: skip
                    for _ in chunks:
                        first_chunk[rank].set()
                    outcomes[rank] = "finished"
                except openai.APIError as exc:
                    outcomes[rank] = f"error: {exc}"
                finally:
                    first_chunk[rank].set()

            streams = [threading.Thread(target=stream, args=(r,)) for r in (0, 1)]
            for thread in streams:
                thread.start()
            for event in first_chunk.values():
                assert event.wait(120)
            killed_at = time.monotonic()
            cluster.kill_node("c")
            for thread in streams:
                thread.join(180)
            assert not any(t.is_alive() for t in streams), "a stream hung"
            detected_s = time.monotonic() - killed_at
            failed = [rank for rank, outcome in outcomes.items() if outcome != "finished"]
            assert len(failed) == 1, outcomes
            on_c = failed[0]
            assert f"data-parallel replica {on_c} died" in outcomes[on_c], outcomes
            assert complete(None).choices[0].text == expected  # balanced onto b
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503

            cluster.restart_node("c")
            restart_s = wait_health(url, 200, timeout=300)
            assert ray_actors_by_node(cluster, "EngineCoreRankActor") == want
            before = generation_tokens_by_engine(url)
            assert complete(on_c).choices[0].text == expected
            after = generation_tokens_by_engine(url)
            assert after[str(on_c)] == before[str(on_c)] + 6
            print(f"node lost: noticed in {detected_s:.1f} s; back: serving {restart_s:.1f} s")
        finally:
            stop(proc)
