"""Offline throughput: enginecore's LLM.generate vs transformers' generate, in one run.

Workloads (random token ids, ignore_eos, greedy, seeded):
- ``fixed``: every prompt ``input_len`` tokens, every output ``output_len`` tokens;
- ``varied``: input uniform in [32, 512], output uniform in [16, 256] — continuous
  batching earns its keep here, static batching pads and waits for the longest output.

transformers runs in a child process (its own peak RSS), with static batches of
``--hf-batch`` prompts, left-padded, generating until the longest requested output of
the batch; only the requested tokens count as output.

Each system is warmed up (enginecore: one short request; transformers: one batch of four
new tokens), then runs the workload ``--reps`` times in one process and reports the median
wall time: single runs on a shared machine drift by 5-10%. enginecore's prefix cache is
reset before each repetition, so every one computes every prompt. ``enginecore bench
compare`` runs the same kind of measurement against vLLM and llama.cpp too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

WORKLOADS = ("fixed", "varied")


def make_workload(
    kind: str, num_prompts: int, input_len: int, output_len: int, vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        n_in = input_len if kind == "fixed" else rng.randint(32, 512)
        n_out = output_len if kind == "fixed" else rng.randint(16, 256)
        items.append(([rng.randrange(10, vocab - 10) for _ in range(n_in)], n_out))
    return items


def machine_line() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


class _RssSampler:
    """Peak RSS of this process and its children (the engine process), sampled."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except Exception:
                pass

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def run_enginecore(
    model: str,
    workload: list[tuple[list[int], int]],
    dtype: str,
    overrides: dict[str, Any],
    reps: int = 1,
) -> dict[str, Any]:
    from enginecore import LLM, SamplingParams

    sampler = _RssSampler()
    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, **overrides)
    startup = time.perf_counter() - t0
    llm.generate({"prompt_token_ids": workload[0][0][:8]}, SamplingParams(max_tokens=1))
    first_token = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in workload]
    walls = []
    for _ in range(reps):
        llm.reset_prefix_cache()
        t1 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - t1)
    llm.shutdown()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p, _ in workload)
    wall = statistics.median(walls)
    return {
        "system": "enginecore",
        "startup_s": startup,
        "startup_to_first_token_s": first_token,
        "wall_s": wall,
        "rep_walls_s": walls,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + in_tokens) / wall,
        "peak_rss_mib": sampler.stop(),
    }


def _hf_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside the child process: transformers static-batch generate."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    pad = model.generation_config.pad_token_id or 0
    load = time.perf_counter() - t0
    workload, batch = spec["workload"], spec["batch"]
    # One untimed batch first: a cold first generate runs ~15% slower than the ones after.
    _hf_generate_all(model, [(p, 4) for p, _ in workload[:batch]], batch, pad)
    walls = []
    for _ in range(spec["reps"]):
        t1 = time.perf_counter()
        useful = _hf_generate_all(model, workload, batch, pad)
        walls.append(time.perf_counter() - t1)
    wall = statistics.median(walls)
    in_tokens = sum(len(p) for p, _ in workload)
    return {
        "system": "transformers",
        "startup_s": load,
        "wall_s": wall,
        "rep_walls_s": walls,
        "output_tokens": useful,
        "output_tok_s": useful / wall,
        "total_tok_s": (useful + in_tokens) / wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _hf_generate_all(
    model: Any, workload: list[tuple[list[int], int]], batch: int, pad: int
) -> int:
    """The workload through ``generate`` in static batches; returns the output tokens that
    were asked for."""
    import torch

    useful = 0
    with torch.inference_mode():
        for start in range(0, len(workload), batch):
            chunk = workload[start : start + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(chunk):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            max_new = max(n for _, n in chunk)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
            useful += sum(n for _, n in chunk)
    return useful


def run_transformers(
    model: str, workload: list[tuple[list[int], int]], dtype: str, batch: int, reps: int = 1
) -> dict[str, Any]:
    spec = json.dumps(
        {"model": model, "workload": workload, "dtype": dtype, "batch": batch, "reps": reps}
    )
    code = (
        "import json, sys; from enginecore.bench.throughput import _hf_child; "
        "print(json.dumps(_hf_child(json.loads(sys.stdin.read()))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], input=spec, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"transformers peer failed:\n{result.stderr[-2000:]}")
    measured: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return measured


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers static batch")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument(
        "--reps", type=int, default=3, help="timed runs per system (the median is reported)"
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="extra engine config, e.g. --engine-arg max_num_seqs=128",
    )
    parser.add_argument("--output-json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    workload = make_workload(
        args.workload, args.num_prompts, args.input_len, args.output_len, vocab, args.seed
    )
    overrides = {}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value[:1] in "[{0123456789tfn-" else value
    results = {"machine": machine_line(), "workload": args.workload, "n": args.num_prompts}
    results["enginecore"] = run_enginecore(args.model, workload, args.dtype, overrides, args.reps)
    if not args.no_peer:
        results["transformers"] = run_transformers(
            args.model, workload, args.dtype, args.hf_batch, args.reps
        )
        results["ratio_output_tok_s"] = (
            results["enginecore"]["output_tok_s"] / results["transformers"]["output_tok_s"]
        )
    print(f"machine: {results['machine']}")
    print(f"workload: {args.workload}, {args.num_prompts} prompts, dtype {args.dtype}")
    for system in ("enginecore", "transformers"):
        r = results.get(system)
        if r:
            print(
                f"{system:>12}: {r['output_tok_s']:8.1f} out tok/s  {r['total_tok_s']:8.1f} "
                f"total tok/s  wall {r['wall_s']:6.2f} s  start-up {r['startup_s']:5.1f} s  "
                f"peak RSS {r['peak_rss_mib']:6.0f} MiB"
            )
            if len(r["rep_walls_s"]) > 1:
                walls = ", ".join(f"{w:.2f}" for w in r["rep_walls_s"])
                print(f"{'':>12}  median of {len(r['rep_walls_s'])} runs ({walls} s)")
    if "ratio_output_tok_s" in results:
        print(
            f"ratio (enginecore / transformers, output tok/s): {results['ratio_output_tok_s']:.2f}x"
        )
    print(
        "enginecore start-up to first token: "
        f"{results['enginecore']['startup_to_first_token_s']:.1f} s"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
