"""Time the Q5_K / Q6_K kernel on its packed layout (the file's bits a value) against the
same product over one byte a value (``tests/kquant_byte_reference.c``, the layout it
replaced, whose results it equals bit for bit), at decode sizes.

One ``--out`` x ``--in`` weight per format is multiplied by ``--rows`` activation rows
(quantized once, outside the timing) with ``--threads`` OpenMP threads; the candidates run
in turn, round after round (the machine may be shared), and each one's best and median
over the rounds are printed in microseconds, with the bytes each layout holds a value.

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
from pathlib import Path

import torch

from enginecore.builtin_cpu import cpu_kernels, kquant_blocks, kquant_kernels, quant_kernels
from enginecore.testing.quantizers import quantize_k

REFERENCE = Path(__file__).parents[1] / "tests" / "kquant_byte_reference.c"


def _reference_lib(directory: Path) -> ctypes.CDLL:
    shutil.copy(kquant_kernels.SOURCE.with_name("quant_simd.h"), directory)
    source = Path(shutil.copy(REFERENCE, directory))
    path = cpu_kernels.build(
        directory, source=source, stem="kquant_bytes", extra_isa=quant_kernels._vnni()
    )
    return ctypes.CDLL(str(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=int, default=576)
    parser.add_argument("--in", dest="inputs", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    packed = kquant_kernels.load()
    if packed is None:
        raise SystemExit("the K-quant kernels could not be built (no C compiler?)")
    torch.manual_seed(0)
    acts = quant_kernels.load().quantize_rows(torch.randn(args.rows, args.inputs))
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    common = (p(acts.q), p(acts.scale), p(acts.scaled_sum))
    shape = (args.out, args.inputs)
    out = torch.empty(args.rows, args.out)
    candidates, held = {}, {}
    fixed = (args.rows, args.out, args.inputs)
    with tempfile.TemporaryDirectory() as tmp:
        reference = _reference_lib(Path(tmp))
        for fmt in ("Q5_K", "Q6_K"):
            raw = torch.from_numpy(quantize_k(torch.randn(shape) * 0.05, fmt))
            part = kquant_blocks.from_gguf(raw, fmt, shape)
            q = kquant_blocks.values(part).to(torch.int8).contiguous()
            d = part.d.repeat_interleave(2, dim=-1).contiguous() if part.bits == 5 else part.d
            m = part.m if part.bits == 5 else torch.zeros(args.out, args.inputs // 32)

            def packed_call(part=part) -> None:
                packed.gemm_s16(acts, part, out)

            def bytes_call(q=q, d=d, m=m) -> None:
                reference.eck_gemm_s16_bytes(
                    *map(ctypes.c_int64, fixed), p(q), p(d), p(m), *common, p(out),
                    ctypes.c_int64(args.out),
                )  # fmt: skip

            candidates[f"{fmt} packed"] = packed_call
            candidates[f"{fmt} a byte a value"] = bytes_call
            values = args.out * args.inputs
            held[f"{fmt} packed"] = sum(t.nbytes for t in (part.qs, part.d, part.m)) * 8 / values
            held[f"{fmt} a byte a value"] = sum(t.nbytes for t in (q, d, m)) * 8 / values
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
