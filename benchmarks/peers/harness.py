"""The timing loop every runner shares (standard library only: it runs in each peer's venv).

A runner is ``PYTHON run_<system>.py SPEC.json RESULT.json``. The spec, written by
``enginecore bench compare``, holds the model, the prompts (token ids, the same for every
system) and the batch sizes. The runner loads its system once, warms it up on one short
request, then for each batch size generates ``output_len`` tokens for the first
``batch_size`` prompts, ``reps`` times, and writes the wall time of each repetition.
The warm-up is the largest batch for a few tokens.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

# generate(prompts, output_len) -> number of output tokens produced
Generate = Callable[[list[list[int]], int], int]
# load(spec) -> (version string, generate, close)
Load = Callable[[dict[str, Any]], tuple[str, Generate, Callable[[], None]]]


def peak_rss_mib() -> float | None:
    """Peak RSS of this process and its children (vLLM runs its engine in a child)."""
    try:
        import psutil
    except ImportError:
        return None
    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total / 2**20


def measure(spec: dict[str, Any], load: Load) -> dict[str, Any]:
    start = time.perf_counter()
    version, generate, close = load(spec)
    startup_s = time.perf_counter() - start
    prompts, output_len = spec["prompts"], spec["output_len"]
    # Warm-up, untimed: the largest batch for a few tokens, so shapes a system compiles or
    # caches on first sight (vLLM's compiled graph, allocator pools) are seen before timing.
    generate(prompts[: max(spec["batch_sizes"])], min(4, output_len))
    points = []
    peak = peak_rss_mib()
    for batch_size in spec["batch_sizes"]:
        walls, produced = [], 0
        for _ in range(spec["reps"]):
            t0 = time.perf_counter()
            produced = generate(prompts[:batch_size], output_len)
            walls.append(time.perf_counter() - t0)
        expected = batch_size * output_len
        if produced != expected:
            raise RuntimeError(f"batch {batch_size}: {produced} output tokens, expected {expected}")
        points.append({"batch_size": batch_size, "rep_walls_s": walls, "output_tokens": produced})
        rss = peak_rss_mib()
        if rss is not None:
            peak = max(peak or 0.0, rss)
    close()
    return {"version": version, "startup_s": startup_s, "peak_rss_mib": peak, "points": points}


def main(load: Load) -> None:
    spec_path, result_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result = measure(spec, load)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
