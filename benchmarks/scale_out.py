"""Scale-out figures on a simulated multi-node Ray cluster (one machine, several raylets).

1. Step overhead: one step (``execute_model`` + ``sample_tokens``, non-blocking, as the
   engine core sends them) through each executor with the conformance kit's stub model
   runner, so the figure is the executor's channel alone. ``mp`` (one host) against
   ``ray`` placed over the simulated nodes, at TP=2 and TP=2 x PP=2; ``ray (2 rounds)`` is
   the same executor driven through the base-class defaults (two Ray calls per rank and
   step), which is how every step went before the step was batched.
2. Loss of a node: the time from SIGKILL of a node's processes to the executor's failure
   callback (every in-flight call has failed by then).
3. Data parallel placement: the same workload (greedy, ``ignore_eos``) through DP=2 on Ray
   with the two replicas on two nodes, then on one node: throughput and TTFT.
4. Faults of a DP=2 Ray deployment over two nodes: SIGKILL of one replica's engine-core
   actor, then of a whole node; the time until the replica is marked dead (detect) and
   until it serves again (recover: restarted at once for a replica, once the node is back
   for a node).
5. P/D with ``zmq_p2p``: TTFT of a handed-off request (prefill instance, then the decode
   instance loading its KV) against one engine (the prefill instance, without the
   handoff) computing a prompt of the same length; the transfer rate the
   decode side measured (bytes / seconds of its fetches) against loopback TCP measured
   with a plain socket; and the loss of the prefill instance after its prefill: the time
   until the decode side fails the request (its ``recv_timeout``), and its KV usage then.

Simulated: each node is a real raylet with its own address on the loopback network and
its own logical CPUs, but they share one kernel, two cores and no real network. A real
cluster adds the network round trip (about 0.05-0.5 ms per hop on a LAN) to every Ray
call, and Ray's default health checks take ~30 s to declare a node dead (tuned to ~3 s
here).

usage: python benchmarks/scale_out.py [--steps 300] [--skip-fault] [--skip-steps]
       [--skip-dp] [--skip-pd] [--num-prompts 16] [--output-len 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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


# --- 3/4. data parallel over nodes ---------------------------------------------------


def tiny_model(directory: str) -> str:
    subprocess.run(
        [sys.executable, "-m", "enginecore.cli", "demo-model", directory, "--random",
         "--arch", "llama", "--size", "tiny"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return directory


DP_ENGINE = dict(dtype="float32", max_model_len=256, num_blocks_override=128, ready_timeout=300)


def workload(num_prompts: int, prompt_len: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(prompt_len)]}
        for _ in range(num_prompts)
    ]


def dp_run(llm, prompts: list[dict], output_len: int) -> dict:
    from enginecore import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = sorted(o.metrics["time_to_first_token"] * 1e3 for o in outs)
    return {
        "tokens_per_s": round(len(prompts) * output_len / elapsed, 1),
        "ttft_mean_ms": round(statistics.fmean(ttft), 1),
        "ttft_p50_ms": round(ttft[len(ttft) // 2], 1),
    }


def wait_until(condition, timeout: float) -> float | None:
    t0 = time.perf_counter()
    while not condition():
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(0.05)
    return round(time.perf_counter() - t0, 2)


def dp_faults(cluster, llm, prompts: list[dict]) -> dict:
    """Replica kill, then node kill, on DP=2 over nodes b and c."""
    from enginecore import SamplingParams

    client = llm.engine_client
    dead = client.coordinator.dead
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    found: dict = {}
    # A replica's engine-core actor dies (its node stays): restarted where it was.
    os.kill(client.engines[1].pid, signal.SIGKILL)
    found["replica_kill_detect_s"] = wait_until(lambda: 1 in dead, 120)
    found["replica_kill_recover_s"] = wait_until(lambda: 1 not in dead, 300)
    llm.generate(prompts[0], params, data_parallel_rank=1, use_tqdm=False)
    # A node dies: its replica is marked dead, and restarted once the node is back.
    node_ips = [a["node_ip"] for a in llm.collective_rpc("device_assignment")]
    on_c = node_ips.index(cluster.node("c").ip) // (len(node_ips) // 2)
    cluster.kill_node("c")
    found["node_kill_detect_s"] = wait_until(lambda: on_c in dead, 120)
    cluster.restart_node("c")
    found["node_return_recover_s"] = wait_until(lambda: on_c not in dead, 300)
    llm.generate(prompts[0], params, data_parallel_rank=on_c, use_tqdm=False)
    return found


def data_parallel_section(model: str, num_prompts: int, output_len: int, faults: bool) -> dict:
    import ray

    from enginecore import LLM
    from enginecore.testing.ray_cluster import SimulatedRayCluster

    prompts = workload(num_prompts)
    results: dict = {"num_prompts": num_prompts, "output_len": output_len, "rows": []}
    # The head runs no replica; each node has room for exactly its replica(s), so a
    # replica whose node died can only come back when that node does.
    layouts = (
        ("two nodes", [("head", 0), ("b", 1), ("c", 1)]),
        ("one node", [("head", 0), ("b", 2)]),
    )
    for label, spec in layouts:
        with SimulatedRayCluster(spec) as cluster:
            llm = LLM(
                model,
                data_parallel_size=2,
                data_parallel_backend="ray",
                ray_address=cluster.address,
                **DP_ENGINE,
            )
            try:
                nodes = [a["node_ip"] for a in llm.collective_rpc("device_assignment")]
                row = {"layout": label, "replica_nodes": nodes, **dp_run(llm, prompts, output_len)}
                results["rows"].append(row)
                print(json.dumps({"dp": row}), flush=True)
                if faults and label == "two nodes":
                    results["faults"] = dp_faults(cluster, llm, prompts)
                    print(json.dumps({"dp_faults": results["faults"]}), flush=True)
            finally:
                llm.shutdown()
                if ray.is_initialized():
                    ray.shutdown()
    return results


# --- 5. P/D over zmq_p2p --------------------------------------------------------------


def loopback_gbps(total_bytes: int = 512 * 1024 * 1024, chunk: int = 1024 * 1024) -> float:
    """Plain TCP over loopback: one sender, one receiver thread, ``total_bytes``."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            while received[0] < total_bytes:
                data = conn.recv(chunk)
                if not data:
                    return
                received[0] += len(data)

    thread = threading.Thread(target=receive)
    thread.start()
    payload = b"x" * chunk
    with socket.create_connection(("127.0.0.1", port)) as sender:
        t0 = time.perf_counter()
        for _ in range(total_bytes // chunk):
            sender.sendall(payload)
        thread.join()
        elapsed = time.perf_counter() - t0
    server.close()
    return round(received[0] / elapsed / 1e9, 3)


def _transfers(worker) -> dict:
    return dict(worker.model_runner.kv_connector.connector.transfers)


def pd_section(model: str, num_prompts: int, prompt_len: int) -> dict:
    from enginecore import LLM, SamplingParams
    from enginecore.testing.kv_connector_contract import free_port

    engine = dict(dtype="float32", max_model_len=1024, num_blocks_override=400)
    kv_port = free_port()
    prompts = workload(num_prompts, prompt_len)
    greedy = dict(temperature=0.0, ignore_eos=True)
    to_decode = SamplingParams(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **greedy
    )
    one = SamplingParams(max_tokens=1, **greedy)

    def connector(role: str, extra: dict) -> dict:
        return {"connector": "zmq_p2p", "role": role, "extra_config": extra}

    found: dict = {"num_prompts": num_prompts, "prompt_len": prompt_len}
    prefill = LLM(model, kv_transfer=connector("kv_producer", {"port": kv_port}), **engine)
    consumer = {"recv_timeout": 5, "peers": [f"127.0.0.1:{kv_port}"]}
    decode = LLM(model, kv_transfer=connector("kv_consumer", consumer), **engine)
    try:
        # In turn (the machine's load drifts), the first of each a warm-up: a prompt
        # computed by the prefill engine alone (the one-engine baseline, in the same
        # process, so both see the same cores), and another through prefill -> decode.
        single_ttft, pd_ttft = [], []
        for alone, prompt in zip(workload(num_prompts, prompt_len, seed=2), prompts, strict=True):
            t0 = time.perf_counter()
            prefill.generate(alone, one, use_tqdm=False)
            single_ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            handoff = prefill.generate(prompt, to_decode, use_tqdm=False)[0].kv_transfer_params
            params = SamplingParams(max_tokens=1, kv_transfer_params=handoff, **greedy)
            decode.generate(prompt, params, use_tqdm=False)
            pd_ttft.append(time.perf_counter() - t0)
        found["single_engine_ttft_ms"] = round(1e3 * statistics.fmean(single_ttft[1:]), 1)
        found["pd_ttft_ms"] = round(1e3 * statistics.fmean(pd_ttft[1:]), 1)
        moved = decode.collective_rpc(_transfers)[0]
        found["kv_fetches"] = moved["fetches"]
        found["kv_bytes"] = moved["bytes"]
        found["kv_wire_gbps"] = round(moved["bytes"] / moved["wire_s"] / 1e9, 3)
        found["kv_into_cache_gbps"] = round(moved["bytes"] / moved["total_s"] / 1e9, 3)
        found["loopback_tcp_gbps"] = loopback_gbps()
        # The prefill instance dies after its prefill, before the decode side fetched (a
        # prompt the decode side has not cached).
        fresh = workload(1, prompt_len, seed=1)[0]
        handoff = prefill.generate(fresh, to_decode, use_tqdm=False)[0].kv_transfer_params
        os.kill(prefill.engine_client.proc.pid, signal.SIGKILL)
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=1, kv_transfer_params=handoff, **greedy)
        out = decode.generate(fresh, params, use_tqdm=False)[0]
        found["prefill_kill_request_failed_s"] = round(time.perf_counter() - t0, 2)
        found["prefill_kill_error"] = out.error
        # The decode side holds nothing for it: no request left, every block free (a
        # prefix-cache reset succeeds only then).
        found["decode_unfinished_after"] = decode.engine_client.call_utility(
            "get_num_unfinished_requests"
        )
        found["decode_blocks_all_free"] = decode.reset_prefix_cache()
    finally:
        decode.shutdown()
        prefill.shutdown()
    return found


def main() -> None:
    import ray

    from enginecore.testing.ray_cluster import SimulatedRayCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-fault", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--skip-pd", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--pd-prompt-len", type=int, default=512)
    args = parser.parse_args()

    results: dict = {
        "machine": platform.processor() or platform.machine(),
        "load_before": os.getloadavg(),
        "rows": [],
    }
    if not (args.skip_dp and args.skip_pd):
        with tempfile.TemporaryDirectory() as tmp:
            model = tiny_model(os.path.join(tmp, "llama-tiny"))
            if not args.skip_dp:
                results["data_parallel"] = data_parallel_section(
                    model, args.num_prompts, args.output_len, not args.skip_fault
                )
            if not args.skip_pd:
                results["pd"] = pd_section(model, 8, args.pd_prompt_len)
                print(json.dumps({"pd": results["pd"]}), flush=True)
    if args.skip_steps:
        results["load_after"] = os.getloadavg()
        print(json.dumps(results, indent=1))
        return
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
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
