"""The engine beside other work: OpenMP wait policies with N busy processes running.

Each trial is a fresh process (libgomp reads its environment once, when it loads) running
an offline ``LLM`` on a GGUF file with one OpenMP setting: the prefill of a
``--prompt-len`` prompt (one output token), single-stream decode tokens/s (the request's
first to last token), and the output tokens/s of ``--batch`` requests decoding together
(the many-row kernels' OpenMP path). ``--busy`` runs that many ``while 1: pass``
processes beside it; within a round the variants alternate at each busy count, so the
ratios between them, not figures taken at other times, are what to compare. The CPU time
the engine core's process took for a prefill (every thread, spinning included) is less
moved by other processes than its wall time. Prints each trial, then a table of the
medians with the load average seen over that busy count.

Variants: ``default`` (the environment as given, OpenMP settings removed: the engine's
default), ``passive`` (``OMP_WAIT_POLICY=passive``), ``active``
(``OMP_WAIT_POLICY=active``), ``spin:N`` (``GOMP_SPINCOUNT=N``; libgomp's own default,
with neither variable set, is ``spin:300000``).

    python benchmarks/under_load.py [MODEL.gguf] [--variants default,passive,spin:300000]
        [--busy 0,1,2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import psutil

OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
BUSY_CODE = "while 1: pass"


def variant_env(variant: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` without OpenMP wait settings, plus the variant's."""
    env = {k: v for k, v in base.items() if k not in OPENMP_VARIABLES}
    if variant == "default":
        return env
    if variant in ("passive", "active"):
        return {**env, "OMP_WAIT_POLICY": variant}
    name, _, count = variant.partition(":")
    if name == "spin" and count.isdigit():
        return {**env, "GOMP_SPINCOUNT": count}
    raise ValueError(f"unknown variant {variant!r} (default, passive, active or spin:N)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a GGUF file (default: the demo GGUF)")
    parser.add_argument("--variants", default="default,passive,spin:300000")
    parser.add_argument("--busy", default="0,1,2", help="busy processes beside each trial")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="requests decoding together")
    parser.add_argument("--batch-len", type=int, default=32, help="tokens each batch request")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    for v in args.variants:
        variant_env(v, {})  # reject an unknown one before anything runs
    args.busy = [int(n) for n in args.busy.split(",")]
    if min(args.busy) < 0 or args.rounds < 1:
        parser.error("--busy counts and --rounds must not be negative")
    return args


def fresh_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other seed's prompt shares a block with (no prefix-cache hits)."""
    return [(17 * i + 7919 * seed) % 20000 + 100 for i in range(length)]


def trial(args: argparse.Namespace) -> dict[str, float]:
    """One process's figures (run with ``--child``)."""
    from enginecore import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=1024)
    try:
        seeds = iter(range(1 << 30))

        def run(max_tokens: int, n: int, length: int) -> tuple[float, list]:
            prompts = [{"prompt_token_ids": fresh_prompt(length, next(seeds))} for _ in range(n)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - started, outputs

        # The engine core's process (every thread): CPU time a prefill took, spinning
        # included; less moved by other processes than the wall time.
        engine = psutil.Process(getattr(llm.engine_client, "proc", psutil.Process()).pid)
        run(4, 1, args.prompt_len)  # warm-up
        prefills, cpus = [], []
        for _ in range(3):
            before = sum(engine.cpu_times()[:2])
            prefills.append(run(1, 1, args.prompt_len)[0])
            cpus.append(sum(engine.cpu_times()[:2]) - before)
        prefill = min(prefills)
        _, (out,) = run(args.decode_len, 1, 8)
        first_to_last = out.metrics["e2e_latency"] - out.metrics["time_to_first_token"]
        batch_s, _ = run(args.batch_len, args.batch, 16)
        return {
            "prefill_ms": prefill * 1e3,
            "prefill_cpu_ms": statistics.median(cpus) * 1e3,
            "decode_tok_s": (args.decode_len - 1) / first_to_last,
            "batch_tok_s": args.batch * args.batch_len / batch_s,
        }
    finally:
        llm.shutdown()


def child_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, __file__, args.model, "--child",
        "--prompt-len", str(args.prompt_len), "--decode-len", str(args.decode_len),
        "--batch", str(args.batch), "--batch-len", str(args.batch_len),
    ]  # fmt: skip


def start_busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_CODE]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def table(
    results: dict[tuple[str, int], list[dict[str, float]]], loads: dict[int, list[float]]
) -> str:
    """Markdown: one row per busy count and variant, the medians over rounds."""
    lines = [
        "| busy | load avg | variant | prefill, ms | its CPU, ms | decode, tok/s | batch, tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for (variant, busy), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        load = loads.get(busy, [0.0])
        cells = [
            statistics.median(r[key] for r in rows)
            for key in ("prefill_ms", "prefill_cpu_ms", "decode_tok_s", "batch_tok_s")
        ]
        lines.append(
            f"| {busy} | {min(load):.1f}-{max(load):.1f} | {variant} | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from enginecore.checkpoints import find_demo_gguf

        args.model = str(find_demo_gguf())
    if args.child:
        print(json.dumps(trial(args)), flush=True)
        return
    results: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    loads: dict[int, list[float]] = defaultdict(list)
    for rnd in range(args.rounds):
        for busy in args.busy:
            procs = start_busy(busy)
            try:
                # Each round starts the alternation at another variant.
                shift = rnd % len(args.variants)
                for variant in args.variants[shift:] + args.variants[:shift]:
                    env = variant_env(variant, dict(os.environ))
                    done = subprocess.run(
                        child_command(args), env=env, capture_output=True, text=True
                    )
                    if done.returncode != 0:
                        sys.exit(f"{variant}, {busy} busy: trial failed\n{done.stderr[-3000:]}")
                    figures = json.loads(done.stdout.strip().splitlines()[-1])
                    load = os.getloadavg()[0]
                    loads[busy].append(load)
                    results[(variant, busy)].append(figures)
                    print(
                        f"round {rnd} busy {busy} {variant}: {figures} load {load:.2f}", flush=True
                    )
            finally:
                stop_busy(procs)
    print(f"\n{os.uname().nodename} cpus {os.cpu_count()}, model {args.model}")
    print(table(results, loads))


if __name__ == "__main__":
    main()
