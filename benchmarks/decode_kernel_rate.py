"""Bytes a second of CPU time that each block format's batch-1 kernel reads, beside what
one core reads with a plain sum: how close each kernel runs to the memory it must stream.

Per format, copies of a weight of ``--out`` x ``--in`` (``--total-mb`` together, beyond
the CPU's caches, as a model's weights are) in the layout the ``gguf`` linear method keeps, each multiplied by one activation
row in turn, ``--rounds`` times; the time is the process's CPU time, so other programs
on a shared machine lengthen it far less than the wall clock (they still share the
memory bus). The figure is the bytes a call reads (Q4_0's offsets are formed, not read)
over the median call's time, and over the best call's (the least disturbed); the reference
is a float32 sum over 512 MiB, timed the same way, on as many threads.

``--isa x86-64-v3`` builds the kernels for that x86-64 level instead of this CPU's (the
AVX2 ones on an AVX-512 CPU, with AVX-VNNI where the CPU has it, as the engine builds them
on an AVX2 CPU). Run under another ``PYTHONPATH`` to time another build of the kernels.

    python benchmarks/decode_kernel_rate.py [--threads 1] [--out 8192 --in 2048] [--isa x86-64-v3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.testing.quantizers import quantize_k
from enginecore_cpu.gguf_linear_method import blocks_linear

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _part(weight: torch.Tensor, fmt: str) -> gguf_blocks.BlockWeight | kquant_blocks.KQuantWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    n, k = weight.shape
    if fmt.endswith("_K"):
        raw = torch.from_numpy(quantize_k(weight, fmt))
        return kquant_blocks.from_gguf(raw, fmt, (n, k))
    raw = torch.from_numpy(quantize(weight.numpy(), GGMLQuantizationType[fmt])).reshape(n, -1)
    return gguf_blocks.from_gguf(raw, fmt, (n, k))


def _cpu_times(calls: list[Callable[[], object]], rounds: int) -> list[float]:
    for call in calls:
        call()  # warm up
    times = []
    for _ in range(rounds):
        for call in calls:
            started = time.process_time()
            call()
            times.append(time.process_time() - started)
    return times


def _bytes_read(part: gguf_blocks.BlockWeight | kquant_blocks.KQuantWeight) -> int:
    if isinstance(part, gguf_blocks.BlockWeight) and getattr(part, "symmetric", False):
        return part.nbytes - part.m.nbytes
    return part.nbytes


def _copy(part: gguf_blocks.BlockWeight | kquant_blocks.KQuantWeight):  # type: ignore[no-untyped-def]
    fields = {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}
    return type(part)(
        **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=int, default=8192)
    parser.add_argument("--in", dest="inputs", type=int, default=2048)
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--isa", help="build the kernels for this x86-64 level")
    args = parser.parse_args()
    if args.isa:
        from enginecore_cpu import cpu_kernels

        cpu_kernels.instruction_set = lambda: args.isa  # type: ignore[assignment]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.out, args.inputs) * 0.05
    x = torch.randn(1, args.inputs)
    big = torch.ones(128 << 20)
    sum_s = statistics.median(_cpu_times([big.sum], 5))
    isa = args.isa or "this CPU's level"
    print(f"{args.out} x {args.inputs} weights, 1 activation row, {args.threads} thread(s), {isa}")
    print(f"float32 sum: {big.nbytes / sum_s / 1e9:.1f} GB/s of CPU time")
    print(
        "| format | MB read a call | median µs of CPU time | GB/s of CPU time | best call, GB/s |"
    )
    print("|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        first = _part(weight, fmt)
        nbytes = _bytes_read(first)
        parts = [first, *(_copy(first) for _ in range(args.total_mb * 10**6 // nbytes))]
        times = _cpu_times([lambda p=p: blocks_linear([(0, p)], x) for p in parts], args.rounds)
        took, best = statistics.median(times), min(t for t in times if t > 0)
        print(
            f"| {fmt} | {nbytes / 1e6:.2f} | {1e6 * took:.0f} | {nbytes / took / 1e9:.1f} "
            f"| {nbytes / best / 1e9:.1f} |"
        )
        del parts, first


if __name__ == "__main__":
    main()
