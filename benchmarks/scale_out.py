"""Scale-out figures on a simulated multi-node Ray cluster (one machine, several raylets).

1. Step overhead: one step (``execute_model`` + ``sample_tokens``, non-blocking, as the
   engine core sends them) through each executor with the conformance kit's stub model
   runner, so the figure is the executor's channel alone. ``mp`` (one host) against
   ``ray`` placed over the simulated nodes, at TP=2 and TP=2 x PP=2; ``ray (2 rounds)`` is
   the same executor driven through the base-class defaults (two Ray calls per rank and
   step), which is how every step went before the step was batched.
2. Loss of a node: the time from SIGKILL of a node's processes to the executor's failure
   callback (every in-flight call has failed by then).

Simulated: each node is a real raylet with its own address on the loopback network and
its own logical CPUs, but they share one kernel, two cores and no real network. A real
cluster adds the network round trip (about 0.05-0.5 ms per hop on a LAN) to every Ray
call, and Ray's default health checks take ~30 s to declare a node dead (tuned to ~3 s
here).

usage: python benchmarks/scale_out.py [--steps 300] [--skip-fault]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import msgspec


def make_executor(name: str, tp: int, pp: int, ray_address: str | None = None):
    from enginecore.config import make_config
    from enginecore.engine.components import resolve_components
    from enginecore.plugins import make_plugin_manager
    from enginecore.testing.executor_contract import STUB_RUNNER_REF

    overrides = dict(
        model="stub", executor=name, tensor_parallel_size=tp, pipeline_parallel_size=pp
    )
    if ray_address:
        overrides["ray_address"] = ray_address
    config = make_config(**overrides)
    components = resolve_components(config, make_plugin_manager())
    spec = msgspec.structs.replace(components.worker_spec, model_runner_ref=STUB_RUNNER_REF)
    return components.executor_cls(config, spec)


def step_overhead(executor, steps: int, two_rounds: bool = False) -> dict:
    from enginecore.interfaces import Executor
    from enginecore.scheduler_output import SchedulerOutput

    def one_step() -> None:
        if two_rounds:  # the base-class defaults: one collective_rpc per call
            execute = Executor.execute_model(executor, SchedulerOutput(), non_block=True)
            sample = Executor.sample_tokens(executor, None, non_block=True)
        else:
            execute = executor.execute_model(SchedulerOutput(), non_block=True)
            sample = executor.sample_tokens(None, non_block=True)
        execute.result()
        sample.result()

    for _ in range(min(50, steps)):
        one_step()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one_step()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {
        "p50_ms": round(statistics.median(samples), 3),
        "p90_ms": round(samples[int(0.9 * (len(samples) - 1))], 3),
        "mean_ms": round(statistics.fmean(samples), 3),
    }


def node_loss(cluster, address: str) -> dict:
    """TP=2 x PP=2 over nodes b and c; SIGKILL node c; time to the failure callback."""
    executor = make_executor("ray", 2, 2, address)
    fired = threading.Event()
    message: list[str] = []
    executor.register_failure_callback(lambda text: (message.append(text), fired.set()))
    try:
        t0 = time.perf_counter()
        cluster.kill_node("c")
        fired.wait(120)
        detected = time.perf_counter() - t0
    finally:
        executor.shutdown()
    return {
        "detect_s": round(detected, 2) if fired.is_set() else None,
        "message": message[0] if message else "none within 120 s",
    }


def main() -> None:
    import ray

    from enginecore.testing.ray_cluster import SimulatedRayCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-fault", action="store_true")
    args = parser.parse_args()

    results: dict = {"machine": platform.processor() or platform.machine(), "rows": []}
    for tp, pp in ((2, 1), (2, 2)):
        executor = make_executor("mp", tp, pp)
        try:
            row = {"executor": "mp", "tp": tp, "pp": pp, **step_overhead(executor, args.steps)}
        finally:
            executor.shutdown()
        results["rows"].append(row)
        print(json.dumps(row), flush=True)

    with SimulatedRayCluster([("head", 1), ("b", 2), ("c", 2)]) as cluster:
        for tp, pp in ((2, 1), (2, 2)):
            executor = make_executor("ray", tp, pp, cluster.address)
            try:
                nodes = sorted(set(executor.node_ips))
                for label, two in (("ray", False), ("ray (2 rounds)", True)):
                    row = {
                        "executor": label,
                        "tp": tp,
                        "pp": pp,
                        "nodes": nodes,
                        **step_overhead(executor, args.steps, two_rounds=two),
                    }
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
            finally:
                executor.shutdown()
        if not args.skip_fault:
            results["node_loss"] = node_loss(cluster, cluster.address)
            print(json.dumps({"node_loss": results["node_loss"]}), flush=True)
        if ray.is_initialized():
            ray.shutdown()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
