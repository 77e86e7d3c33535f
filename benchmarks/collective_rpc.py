"""Executor benchmarks: collective_rpc broadcast latency, and TP=1 vs TP=2 throughput.

1. Latency of ``collective_rpc("check_health")`` -- an empty method -- per call, p50 and
   p99 in microseconds, for ``uni`` (reference), ``mp`` with 1 and 2 ranks and ``ray``
   with 1 and 2 ranks. The executors run the real generic Worker with the conformance
   kit's stub model runner, so the number is the channel alone: serialize, broadcast,
   every rank answers, the Future settles.
2. End-to-end generation throughput (output tokens/s) of the ``small`` random Llama
   checkpoint (hidden 768, 12 layers, 88M parameters) at TP=1 and TP=2 (``mp``).

usage: python benchmarks/collective_rpc.py [--calls 2000] [--skip-ray] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import msgspec


def make_executor(name: str, world_size: int):
    from enginecore.config import make_config
    from enginecore.engine.components import resolve_components
    from enginecore.plugins import make_plugin_manager
    from enginecore.testing.executor_contract import STUB_RUNNER_REF

    config = make_config(model="stub", executor=name, tensor_parallel_size=world_size)
    components = resolve_components(config, make_plugin_manager())
    spec = msgspec.structs.replace(components.worker_spec, model_runner_ref=STUB_RUNNER_REF)
    return components.executor_cls(config, spec)


def rpc_latency(name: str, world_size: int, calls: int) -> dict:
    executor = make_executor(name, world_size)
    try:
        for _ in range(min(200, calls)):  # warm up
            executor.collective_rpc("check_health")
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            executor.collective_rpc("check_health")
            samples.append((time.perf_counter() - t0) * 1e6)
    finally:
        executor.shutdown()
    samples.sort()
    return {
        "executor": name,
        "ranks": world_size,
        "calls": calls,
        "p50_us": round(statistics.median(samples), 1),
        "p99_us": round(samples[int(0.99 * (len(samples) - 1))], 1),
        "mean_us": round(statistics.fmean(samples), 1),
    }


def e2e_throughput(path: str, tp: int, num_prompts: int, max_tokens: int) -> dict:
    from enginecore import LLM, SamplingParams

    prompts = [
        f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(num_prompts)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(path, tensor_parallel_size=tp, dtype="float32", max_model_len=1024) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        executor = llm.engine_client.ready.components["executor"].split()[0]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tp": tp,
        "executor": executor,
        "prompts": num_prompts,
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args()

    results: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "rpc": [],
        "e2e": [],
    }
    cases = [("uni", 1), ("mp", 1), ("mp", 2)]
    if not args.skip_ray:
        try:
            import ray

            ray.init(
                num_cpus=4,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
            )
            cases += [("ray", 1), ("ray", 2)]
        except ImportError:
            print("ray is not installed: pip install 'enginecore[ray]' (skipping ray)")
    for name, ranks in cases:
        calls = args.calls if name != "ray" else max(200, args.calls // 4)
        row = rpc_latency(name, ranks, calls)
        results["rpc"].append(row)
        print(
            f"collective_rpc {name:>4} x{ranks}: p50 {row['p50_us']:8.1f} us  "
            f"p99 {row['p99_us']:8.1f} us  ({row['calls']} calls)"
        )

    if not args.skip_e2e:
        from enginecore.checkpoints import make_random_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            path = str(
                make_random_checkpoint(pathlib.Path(tmp) / "small", arch="llama", size="small")
            )
            for tp in (1, 2):
                row = e2e_throughput(path, tp, args.prompts, args.max_tokens)
                results["e2e"].append(row)
                print(
                    f"small llama TP={tp} ({row['executor']}): {row['tokens_per_s']} tok/s "
                    f"({row['output_tokens']} tokens in {row['seconds']} s)"
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
