"""Seconds of compiling the CPU backend's C libraries into an empty cache, as a GGUF's
first load does: each library alone (one after another), and all of them started at once
(what ``cpu_kernels.build_in_background`` does while the weights load).

Each measurement is a fresh process with a cache directory of its own. ``--opt`` builds
with another optimization level in place of ``-O3`` (the kernels' speed at that level is
measured by the kernel benchmarks, not here). Modes alternate within one invocation, so
both see the same machine load.

    python benchmarks/kernel_build.py [--rounds 1] [--opt=-O3 --opt=-O2]
    python benchmarks/kernel_build.py --speed MODEL.gguf --rounds 3 --opt=-O3 --opt=-O2

``--speed``: instead, the model's prefill (128 tokens) and single-stream decode with the
kernels built at each level, alternating (each level's cache kept across rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

RUN = """
import json, sys, time
from enginecore_cpu import cpu_kernels, decode_step, kquant_kernels, quant_gemm, quant_kernels
cpu_kernels.FLAGS[:] = [sys.argv[2] if f == "-O3" else f for f in cpu_kernels.FLAGS]
builds = {"cpu_kernels": cpu_kernels.build, "quant_kernels": quant_kernels.build,
          "kquant_kernels": kquant_kernels.build, "quant_gemm": quant_gemm.build,
          "decode_step": decode_step.build}
seconds = {}
start = time.perf_counter()
if sys.argv[1] == "one after another":
    for name, build in builds.items():
        t = time.perf_counter()
        build()
        seconds[name] = round(time.perf_counter() - t, 2)
else:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(builds)) as pool:
        for future in [pool.submit(b) for b in builds.values()]:
            future.result()
seconds["all"] = round(time.perf_counter() - start, 2)
print(json.dumps(seconds))
"""

SPEED = """
import json, sys, time
from enginecore_cpu import cpu_kernels
cpu_kernels.FLAGS[:] = [sys.argv[2] if f == "-O3" else f for f in cpu_kernels.FLAGS]
from enginecore_cpu import decode_step
decode_step.build()  # the fused step from the first decode
from enginecore import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=512, multiprocessing=False)
def timed(prompt, tokens):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t
timed(list(range(100, 140)), 4)  # warm-up
prefill = min(timed(list(range(s, s + 128)), 1) for s in (300, 700, 1100))
decode = timed(list(range(1500, 1508)), 65) - timed(list(range(1600, 1608)), 1)
print(json.dumps({"prefill_128_ms": round(prefill * 1e3, 1), "decode_tok_s": round(64 / decode, 2)}))
llm.shutdown()
"""


def child(code: str, args: list[str], cache: str, failed: str) -> dict[str, float]:
    """Run ``code`` in a new interpreter with ``cache`` as the kernel cache; its last line
    of output is the JSON result."""
    env = dict(os.environ, ENGINECORE_CACHE_DIR=cache, ENGINECORE_STARTUP_LOG="0")
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"{failed}:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def speed(model: str, opt: str, cache: str) -> dict[str, float]:
    """Prefill of 128 tokens and single-stream decode on ``model`` with the kernels built
    at ``opt`` (into ``cache``, kept across rounds)."""
    return child(SPEED, [model, opt], cache, "the run failed")


def run(mode: str, opt: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        return child(RUN, [mode, opt], cache, "the build failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--opt", action="append", help="optimization flag (default: -O3)")
    parser.add_argument(
        "--mode", action="append", choices=["one after another", "all at once"], default=None
    )
    parser.add_argument("--speed", metavar="MODEL", help="instead: the model's speed per --opt")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    if args.speed:
        caches = {opt: tempfile.mkdtemp() for opt in args.opt or ["-O3"]}
        try:
            for _ in range(args.rounds):
                for opt, cache in caches.items():
                    print(json.dumps({"opt": opt, **speed(args.speed, opt, cache)}), flush=True)
        finally:
            for cache in caches.values():
                shutil.rmtree(cache, ignore_errors=True)
        print(f"load average {os.getloadavg()}")
        return
    for _ in range(args.rounds):
        for opt in args.opt or ["-O3"]:
            for mode in args.mode or ["one after another", "all at once"]:
                print(json.dumps({"opt": opt, "mode": mode, **run(mode, opt)}), flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
