"""Data parallelism: offline throughput of DP=N against DP=1 in one run, with a CPU profile.

For each DP size the same workload (random prompt ids, greedy, ``ignore_eos``) runs through
``LLM.generate`` once to warm up and then ``--repeats`` times, measured. While measuring,
a sampler reads the CPU time of the frontend (this process) and of every engine-core
process, per OS thread, so the result says where the cores went: the frontend
(tokenize/detokenize, output processing, the ZeroMQ reader), each engine's busy loop and
I/O threads, and each engine's torch compute threads.

    python benchmarks/data_parallel.py models/llama-tiny --num-prompts 64 --output-len 64
    python benchmarks/data_parallel.py models/llama-small --num-prompts 32 --output-len 32

Make the checkpoints with ``enginecore demo-model DIR --random --arch llama --size tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any


def engine_pids(llm: Any) -> list[int]:
    client = llm.engine_client
    if hasattr(client, "engines"):
        return [engine.proc.pid for engine in client.engines]
    return [client.proc.pid]


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds per OS thread id of a process."""
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def _python_thread_names(worker: Any = None) -> dict[int, str]:
    import threading

    return {t.native_id: t.name for t in threading.enumerate()}


def thread_roles(pid: int, python_names: dict[int, str]) -> dict[int, str]:
    """A role per OS thread: Python threads by name, the main thread, ZeroMQ's I/O
    threads, and the rest (OpenMP/torch intra-op pool) as compute threads."""
    roles = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        tid_int = int(tid)
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if tid_int == pid:
            roles[tid_int] = "main"
        elif tid_int in python_names:
            roles[tid_int] = python_names[tid_int]
        elif comm.startswith("ZMQ"):
            roles[tid_int] = "zmq-io"
        else:
            roles[tid_int] = "torch-compute"
    return roles


def profile_delta(before: dict, after: dict, wall: float, roles: dict) -> dict[str, Any]:
    by_role: dict[str, float] = {}
    for tid, cpu in after.items():
        role = roles.get(tid, "torch-compute")
        by_role[role] = by_role.get(role, 0.0) + cpu - before.get(tid, 0.0)
    return {
        "cores": round(sum(by_role.values()) / wall, 3),
        "by_role": {
            role: round(cpu / wall, 3)
            for role, cpu in sorted(by_role.items(), key=lambda kv: -kv[1])
            if cpu / wall >= 0.005
        },
    }


class Setup:
    """One LLM with ``dp`` replicas, kept alive so runs of the DP sizes interleave."""

    def __init__(self, path: str, spec: str, warmup: list, params: Any) -> None:
        from enginecore import LLM

        # "2" is DP=2 with the default threads; "1x1" is DP=1 with one torch thread per
        # engine (OMP_NUM_THREADS, inherited by the engine process at start).
        dp_text, _, threads = spec.partition("x")
        self.spec = spec
        self.dp = dp = int(dp_text)
        saved = os.environ.get("OMP_NUM_THREADS")
        if threads:
            os.environ["OMP_NUM_THREADS"] = threads
        try:
            self.llm = LLM(path, dtype="float32", data_parallel_size=dp, stat_loggers=[])
        finally:
            if threads:
                if saved is None:
                    os.environ.pop("OMP_NUM_THREADS")
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
        self.llm.generate(warmup[: max(2, dp)], params)  # every replica warmed up
        self.pids = [os.getpid(), *engine_pids(self.llm)]
        # Engine-side Python thread names, asked through each replica's worker (in the
        # engine process with the uni executor).
        remote = self.llm.collective_rpc(_python_thread_names_fn())
        self.roles = {os.getpid(): thread_roles(os.getpid(), _python_thread_names())}
        for pid, names in zip(self.pids[1:], remote, strict=True):
            self.roles[pid] = thread_roles(pid, {int(k): v for k, v in names.items()})
        self.torch_threads = self.llm.collective_rpc(_torch_threads_fn())
        self.walls: list[float] = []
        self.best_profile: dict | None = None
        self.outputs: list | None = None
        self.tokens = 0

    def run_once(self, batch: list, params: Any) -> None:
        before = {pid: thread_cpu(pid) for pid in self.pids}
        load = os.getloadavg()[0]
        start = time.perf_counter()
        outputs = self.llm.generate(batch, params)
        wall = time.perf_counter() - start
        after = {pid: thread_cpu(pid) for pid in self.pids}
        self.walls.append(wall)
        self.tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        self.outputs = [o.outputs[0].token_ids for o in outputs]
        if wall == min(self.walls):
            profile = {
                ("frontend" if i == 0 else f"engine {i - 1}"): profile_delta(
                    before[pid], after[pid], wall, self.roles[pid]
                )
                for i, pid in enumerate(self.pids)
            }
            cores = sum(p["cores"] for p in profile.values())
            self.best_profile = {
                "processes": profile,
                "cores_used": round(cores, 3),
                "cpu_ms_per_output_token": round(1000 * cores * wall / self.tokens, 3),
                "load_avg_1m_before": load,
            }

    def result(self) -> dict:
        best = min(self.walls)
        median = sorted(self.walls)[len(self.walls) // 2]
        return {
            "setup": self.spec,
            "dp": self.dp,
            "torch_threads_per_engine": self.torch_threads,
            "output_tokens": self.tokens,
            "seconds": [round(w, 3) for w in self.walls],
            "best_tokens_per_s": round(self.tokens / best, 1),
            "median_tokens_per_s": round(self.tokens / median, 1),
            "profile_of_best_run": self.best_profile,
        }


def _python_thread_names_fn():
    def names(worker: Any) -> dict[str, str]:
        import threading

        return {str(t.native_id): t.name for t in threading.enumerate()}

    return names


def _torch_threads_fn():
    def threads(worker: Any) -> int:
        import torch

        return torch.get_num_threads()

    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--dp",
        default="1,2",
        help="DP sizes, the first is the baseline; NxT pins T torch threads per engine",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from enginecore import SamplingParams
    from enginecore.bench.throughput import machine_line

    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 8000) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    print(machine_line())
    setups = [Setup(args.model, spec, batch, params) for spec in args.dp.split(",")]
    try:
        for _ in range(args.repeats):  # interleaved: other load on the machine hits all alike
            for setup in setups:
                setup.run_once(batch, params)
    finally:
        for setup in setups:
            setup.llm.shutdown()
    base = setups[0]
    results = []
    for setup in setups:
        result = setup.result()
        results.append(result)
        ratio = result["best_tokens_per_s"] / base.result()["best_tokens_per_s"]
        median_ratio = result["median_tokens_per_s"] / base.result()["median_tokens_per_s"]
        print(
            f"DP={setup.spec}: {result['output_tokens']} tokens, best {result['best_tokens_per_s']} "
            f"tok/s (median {result['median_tokens_per_s']}), runs {result['seconds']} s, "
            f"x{ratio:.2f} best / x{median_ratio:.2f} median vs DP={base.spec}, "
            f"torch threads per engine {result['torch_threads_per_engine']}, "
            f"outputs equal to DP={base.spec}: {setup.outputs == base.outputs}"
        )
        profile = result["profile_of_best_run"]
        for who, prof in profile["processes"].items():
            roles = ", ".join(f"{role} {cores}" for role, cores in prof["by_role"].items())
            print(f"    {who}: {prof['cores']} cores ({roles})")
        print(
            f"    all processes: {profile['cores_used']} cores, "
            f"{profile['cpu_ms_per_output_token']} CPU-ms per output token; "
            f"1-min load average before that run: {profile['load_avg_1m_before']:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine_line(), "args": vars(args), "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
