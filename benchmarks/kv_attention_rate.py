"""Decode attention over a float32, float16 and bfloat16 decode mirror: CPU time per pass.

``ec_decode_attention`` (the layers' kernel; the fused step runs the same loop span by
span) on one thread over mirror layers shaped as the decode mirror lays them out, the
K/V dtypes taking turns round after round, so that a loaded machine slows each alike.
Each figure is the median over rounds of one pass's CPU time (the thread's, not the wall
clock: less moved by other processes), with the K/V bytes a pass reads and their rate.

- ``host``: ``host_overhead.py``'s checkpoint at 256 requests (one layer, one KV head of
  dim 32, two query heads), contexts spread over 16-216 positions
- ``1.7b``: one request of SmolLM2-1.7B's shape (24 layers of 32 KV heads of dim 64) at
  position 192, every layer its own tensor (75 MB in float32: beyond the caches)

    python benchmarks/kv_attention_rate.py [--shapes host,1.7b] [--rounds 7] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from enginecore_cpu import cpu_kernels

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# name -> (rows, layers, kv heads, query heads per KV head, head dim, capacity, lengths)
SHAPES = {
    "host": (256, 1, 1, 2, 32, 480, lambda rows: torch.linspace(16, 216, rows).long()),
    "1.7b": (1, 24, 32, 1, 64, 256, lambda rows: torch.full((rows,), 192)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="host,1.7b")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20, help="passes timed a round")
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("no C compiler: the kernels are not built")
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {cpu_kernels.instruction_set()}")
    for shape in args.shapes.split(","):
        rows, layers, hkv, group, dim, cap, lengths = SHAPES[shape]
        lens = lengths(rows)
        query = torch.randn(rows, hkv * group, dim)
        base = [torch.randn(2, rows, hkv, cap, dim) for _ in range(layers)]
        mirrors = {n: [b.to(DTYPES[n]) for b in base] for n in args.dtypes.split(",")}
        del base
        times: dict[str, list[float]] = {n: [] for n in mirrors}
        for _ in range(args.rounds):
            for name, layer_list in mirrors.items():
                start = time.thread_time()
                for _ in range(args.reps):
                    for layer in layer_list:
                        kernels.decode_attention(query, layer, lens, dim**-0.5, None)
                times[name].append((time.thread_time() - start) / args.reps)
        positions = int(lens.sum())
        first = next(iter(times))
        for name, got in times.items():
            t = statistics.median(got)
            nbytes = layers * 2 * positions * hkv * dim * DTYPES[name].itemsize
            print(
                f"{shape:>5} {name:>9}: {1e3 * t:.3f} ms a pass (CPU time; rounds "
                f"{', '.join(f'{1e3 * x:.3f}' for x in got)}), {nbytes / 1e6:.1f} MB of K/V, "
                f"{nbytes / t / 1e9:.1f} GB/s; {statistics.median(times[first]) / t:.2f}x "
                f"{first}'s speed"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
