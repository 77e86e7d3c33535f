"""Time the K-quant kernels on the layout the ``gguf`` method keeps (the file's bits a value,
its scales per super-block of 256) against the same products with float32 scales kept
beside the values, whose results they equal bit for bit: Q4_K against 4-bit blocks of 32
with a float32 scale and offset each (``quant_kernels``' kind 4), Q5_K / Q6_K against one
byte a value with a float32 scale per 16 values (``tests/models/kquant_byte_reference.c``).

One ``--out`` x ``--in`` weight per format is multiplied by ``--rows`` activation rows with
``--threads`` OpenMP threads (Q4_K's candidates quantize the activations in the call, as
the engine's does; Q5_K's and Q6_K's take them quantized beforehand); the candidates run
in turn, round after round (the machine may be shared), and each one's best and median
over the rounds are printed in microseconds, with the bits each layout holds a value.
``--formats`` picks some of the formats.

    python benchmarks/kquant_layout_timing.py [--out 576 --in 1536 --rows 1 --rounds 300]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from enginecore.block_formats import kquant_blocks
from enginecore.testing.quantizers import quantize_k
from enginecore_cpu import cpu_kernels, kquant_kernels, quant_kernels

REFERENCE = Path(__file__).parents[1] / "tests" / "models" / "kquant_byte_reference.c"


def _reference_lib(directory: Path) -> ctypes.CDLL:
    shutil.copy(kquant_kernels.SOURCE.with_name("quant_simd.h"), directory)
    source = Path(shutil.copy(REFERENCE, directory))
    path = cpu_kernels.build(
        directory, source=source, stem="kquant_bytes", extra_isa=quant_kernels._vnni()
    )
    return ctypes.CDLL(str(path))


def _bits(tensors: tuple[torch.Tensor, ...], values: int) -> float:
    return sum(t.nbytes for t in tensors) * 8 / values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=int, default=576)
    parser.add_argument("--in", dest="inputs", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--formats", default=",".join(kquant_blocks.FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kquant, quant = kquant_kernels.load(), quant_kernels.load()
    if kquant is None or quant is None:
        raise SystemExit("the K-quant kernels could not be built (no C compiler?)")
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.inputs)
    acts = quant.quantize_rows(x)
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    common = (p(acts.q), p(acts.scale), p(acts.scaled_sum))
    shape = (args.out, args.inputs)
    values = args.out * args.inputs
    out = torch.empty(args.rows, args.out)
    candidates: dict[str, Callable[[], None]] = {}
    held: dict[str, float] = {}
    fixed = (args.rows, args.out, args.inputs)
    with tempfile.TemporaryDirectory() as tmp:
        reference = _reference_lib(Path(tmp))
        for fmt in args.formats.split(","):
            raw = torch.from_numpy(quantize_k(torch.randn(shape) * 0.05, fmt))
            part = kquant_blocks.from_gguf(raw, fmt, shape)
            file_scales, float_scales = f"{fmt} file's scales", f"{fmt} float32 scales"
            held[file_scales] = _bits((part.qs, part.scales), values)
            if fmt == "Q4_K":
                wide = kquant_blocks.four_bit_blocks(part)
                candidates[file_scales] = lambda part=part: quant.linear(x, part, out)
                candidates[float_scales] = lambda wide=wide: quant.linear(x, wide, out)
                held[float_scales] = _bits((wide.qs, wide.d, wide.m), values)
                continue
            q = kquant_blocks.values(part).to(torch.int8).contiguous()
            d, m = kquant_blocks.float_scales(part)
            d = d.repeat_interleave(2, dim=-1).contiguous() if part.bits == 5 else d
            m = m if part.bits == 5 else torch.zeros(args.out, args.inputs // 32)

            def bytes_call(q=q, d=d, m=m) -> None:
                reference.eck_gemm_s16_bytes(
                    *map(ctypes.c_int64, fixed), p(q), p(d), p(m), *common, p(out),
                    ctypes.c_int64(args.out),
                )  # fmt: skip

            candidates[file_scales] = lambda part=part: kquant.gemm_k(acts, part, out)
            candidates[f"{float_scales}, a byte a value"] = bytes_call
            held[f"{float_scales}, a byte a value"] = _bits((q, d, m), values)
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for fn in candidates.values():
            for _ in range(10):
                fn()
        for _ in range(args.rounds):
            for name, fn in candidates.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    print(
        f"{args.out} x {args.inputs} weight, {args.rows} row(s), {torch.get_num_threads()} "
        f"threads, {args.rounds} alternating rounds, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print("| layout | bits a value held | best µs | median µs |\n|---|---|---|---|")
    for name, t in times.items():
        best, median = 1e6 * min(t), 1e6 * statistics.median(t)
        print(f"| {name} | {held[name]:.2f} | {best:.1f} | {median:.1f} |")


if __name__ == "__main__":
    main()
