"""Decode attention over a float32, float16 and bfloat16 decode mirror: CPU time per pass.

``ec_decode_attention`` (the layers' kernel; the fused step runs the same loop span by
span) on one thread over mirror layers shaped as the decode mirror lays them out, the
K/V dtypes taking turns round after round, so that a loaded machine slows each alike.
Each figure is the median over rounds of one pass's CPU time (the thread's, not the wall
clock: less moved by other processes), with the K/V bytes a pass reads and their rate.

- ``host``: ``host_overhead.py``'s checkpoint at 256 requests (one layer, one KV head of
  dim 32, two query heads), contexts spread over 16-216 positions
- ``1.7b``: one request of SmolLM2-1.7B's shape (24 layers of 32 KV heads of dim 64) at
  position 192 (``--positions``), every layer its own tensor (75 MB in float32: beyond
  the caches)

``--layouts`` compares the mirror's layouts the same way, taking turns with the dtypes,
each with its resident memory (``Rss`` in ``/proc/self/smaps``):

- ``chunks``: the mirror as the engine lays it out (``mirror_layout``: a row's positions
  in chunks of whole 2 MiB pages, advised into huge pages as the row grows);
  ``chunks@N``: with a layer's K (or V) of a chunk in N huge pages
- ``dense``: ``[2, rows, kv_heads, capacity + 16, head_dim]`` per layer in 4 KiB pages,
  the layout before the chunks (``--capacity`` positions a row: the model's length)
- ``dense-huge``: the same advised ``MADV_HUGEPAGE`` whole: each head's few positions of
  a short context make a huge page resident

    python benchmarks/kv_attention_rate.py [--shapes host,1.7b] [--rounds 7] [--reps 20]
    python benchmarks/kv_attention_rate.py --shapes 1.7b --dtypes float32 \
        --layouts dense,chunks --positions 1024 --capacity 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from enginecore_cpu import cpu_kernels
from enginecore_cpu.host_memory import advise_pages, mappings_under, zeroed

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# name -> (rows, layers, kv heads, query heads per KV head, head dim, capacity, lengths)
SHAPES = {
    "host": (256, 1, 1, 2, 32, 480, lambda rows: torch.linspace(16, 216, rows).long()),
    "1.7b": (1, 24, 32, 1, 64, 256, lambda rows: torch.full((rows,), 192)),
}


def _mirror(
    layout: str,
    layers: int,
    rows: int,
    hkv: int,
    dim: int,
    capacity: int,
    dtype: torch.dtype,
    lens: torch.Tensor,
) -> list[torch.Tensor]:
    """Mirror layers of ``layout`` holding random K/V at each row's first ``lens``."""
    if layout == "random":  # the tensors this benchmark always took
        return [torch.randn(2, rows, hkv, capacity, dim).to(dtype) for _ in range(layers)]
    if layout.startswith("chunks"):
        from enginecore_cpu import mirror_layout
        from enginecore_cpu.mirror_layout import MirrorLayout, MirrorMemory, write_positions

        chunk_bytes = mirror_layout.CHUNK_BYTES
        if "@" in layout:  # chunks@N: a layer's K (or V) of a chunk in N huge pages
            mirror_layout.CHUNK_BYTES = int(layout.split("@")[1]) * mirror_layout.HUGE_PAGE
        plan = MirrorLayout.plan(layers, hkv, dim, dtype, rows, capacity)
        mirror_layout.CHUNK_BYTES = chunk_bytes
        memory = MirrorMemory(plan, dtype)
        for row, length in enumerate(lens.tolist()):
            memory.advise_row(row, length)
            for layer in memory.layers:
                kv = torch.randn(2, 1, hkv, length, dim).to(dtype)
                write_positions(layer, slice(row, row + 1), 0, kv)
        return memory.layers
    made = []
    for _ in range(layers):
        layer = zeroed((2, rows, hkv, capacity + 16, dim), dtype, torch.device("cpu"))
        if layout == "dense-huge":
            advise_pages(layer.data_ptr(), layer.numel() * layer.element_size(), huge=True)
        for row, length in enumerate(lens.tolist()):
            layer[:, row, :, :length] = torch.randn(2, hkv, length, dim).to(dtype)
        made.append(layer[:, :, :, :capacity])
    return made


def _resident(layers: list[torch.Tensor]) -> tuple[int, int]:
    """Bytes of the mappings under ``layers`` resident, and of them in huge pages."""
    fields = mappings_under(*layers)
    return fields.get("Rss", 0), fields.get("AnonHugePages", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="host,1.7b")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20, help="passes timed a round")
    parser.add_argument("--layouts", default="random", help="random, dense, dense-huge, chunks")
    parser.add_argument("--positions", type=int, help="the 1.7b shape's row length")
    parser.add_argument("--capacity", type=int, help="positions a row holds (dense layouts)")
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("no C compiler: the kernels are not built")
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {cpu_kernels.instruction_set()}")
    for shape in args.shapes.split(","):
        rows, layers, hkv, group, dim, cap, lengths = SHAPES[shape]
        lens = lengths(rows)
        if shape == "1.7b" and args.positions:
            lens = torch.full((rows,), args.positions)
        cap = max(args.capacity or cap, int(lens.max()))
        query = torch.randn(rows, hkv * group, dim)
        mirrors = {
            f"{n} {layout}" if layout != "random" else n: _mirror(
                layout, layers, rows, hkv, dim, cap, DTYPES[n], lens
            )
            for n in args.dtypes.split(",")
            for layout in args.layouts.split(",")
        }
        for name, layer_list in mirrors.items():
            rss, huge = _resident(layer_list)
            print(f"{shape:>5} {name}: {rss / 2**20:.1f} MiB resident, {huge / 2**20:.1f} huge")
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
            nbytes = layers * 2 * positions * hkv * dim * DTYPES[name.split()[0]].itemsize
            print(
                f"{shape:>5} {name:>9}: {1e3 * t:.3f} ms a pass (CPU time; rounds "
                f"{', '.join(f'{1e3 * x:.3f}' for x in got)}), {nbytes / 1e6:.1f} MB of K/V, "
                f"{nbytes / t / 1e9:.1f} GB/s; {statistics.median(times[first]) / t:.2f}x "
                f"{first}'s speed"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
