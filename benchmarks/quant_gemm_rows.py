"""Where the many-row quantized GEMM (``quant_gemm.c``) stands against the ``gguf``
method's other paths, per block format and activation row count: one 1.7B-parameter
layer's projections (SmolLM2-1.7B's shapes: 2048 -> 2048 x 4, 2048 -> 8192 x 2,
8192 -> 2048) of random weights, multiplied by R rows through

- ``gemm``: ``quant_gemm`` (activations quantized once, each weight block decoded once);
- ``rows``: the one-row kernels, four activation rows at a time (``quant_kernels``,
  ``kquant_kernels``);
- ``float32``: ``F.linear`` on the float32 copy (made beforehand, as the background
  copies were);
- ``dequant``: the same with the copy's tiles de-quantized per call (a layer whose copy
  has not landed yet),

alternating, best of ``--rounds``: ms of CPU time for the layer's projections (on a
shared machine CPU time, on one thread, is what stays comparable; ``--threads 2 --wall``
on a quiet one).

    python benchmarks/quant_gemm_rows.py [--rows 2,8,32,128,512] [--formats Q4_0,Q4_K]

``--level x86-64-v3`` (and ``--avx-vnni``) builds ``quant_gemm`` for that x86-64 level
instead of this CPU's own, to see an AVX2 CPU's kernel on an AVX-512 one; run it under
``MKL_ENABLE_INSTRUCTIONS=AVX2`` so that the float32 paths' GEMM is AVX2's too.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = [(2048, 2048)] * 4 + [(8192, 2048)] * 2 + [(2048, 8192)]
PATHS = ("gemm", "rows", "float32", "dequant")


def _weight(fmt: str, n: int, k: int) -> Any:
    import gguf.quants
    from gguf import GGMLQuantizationType

    from enginecore.block_formats import gguf_blocks, kquant_blocks
    from enginecore.testing.quantizers import quantize_k

    w = torch.randn(n, k) * 0.02
    if fmt.endswith("_K"):
        return kquant_blocks.from_gguf(torch.from_numpy(quantize_k(w, fmt)), fmt, (n, k))
    raw = gguf.quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    return gguf_blocks.from_gguf(torch.from_numpy(raw).reshape(n, -1), fmt, (n, k))


def _gemm_for(level: str | None, avx_vnni: bool) -> Any:
    """``quant_gemm`` as the engine builds it here, or for the x86-64 ``level``."""
    import tempfile
    from pathlib import Path

    from enginecore_cpu import cpu_kernels, quant_gemm

    if level is None:
        return quant_gemm.load()
    own = cpu_kernels.instruction_set
    cpu_kernels.instruction_set = lambda: level  # type: ignore[assignment]
    try:
        extra = ("avxvnni", ["-mavxvnni"]) if avx_vnni else None
        path = cpu_kernels.build(
            Path(tempfile.mkdtemp()), source=quant_gemm.SOURCE, stem="quant_gemm", extra_isa=extra
        )
    finally:
        cpu_kernels.instruction_set = own  # type: ignore[assignment]
    return quant_gemm.QuantGemm(path, vnni=avx_vnni)


def measure(
    fmt: str, rows_list: list[int], rounds: int, clock: Callable[[], float], gemm: Any
) -> list[str]:
    from enginecore_cpu import gguf_linear_method as glm
    from enginecore_cpu import quant_kernels

    kernels = quant_kernels.load()
    assert kernels is not None and gemm is not None, "the C kernels did not build"
    parts = [_weight(fmt, n, k) for n, k in SHAPES]
    dense = [glm._dequantize_with(kernels, part) for part in parts]
    lines = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        outs = [torch.empty(rows, n) for n, _ in SHAPES]

        def run_gemm(xs: dict = xs, outs: list = outs) -> None:
            for part, out in zip(parts, outs, strict=True):
                gemm.gemm(kernels.quantize_rows(xs[part.shape[1]]), part, out)

        def run_rows(xs: dict = xs, outs: list = outs) -> None:
            for part, out in zip(parts, outs, strict=True):
                x = xs[part.shape[1]]
                if glm._needs_kquant(part):
                    glm._kquant().gemm_k(kernels.quantize_rows(x), part, out)
                else:
                    kernels.linear(x, part, out)

        def run_float(xs: dict = xs) -> None:
            for part, weight in zip(parts, dense, strict=True):
                F.linear(xs[part.shape[1]], weight)

        def run_dequant(xs: dict = xs, outs: list = outs) -> None:
            for part, out in zip(parts, outs, strict=True):
                n, k = part.shape
                tile = max(16, glm._TILE_BYTES // (4 * k))
                for start in range(0, n, tile):
                    weight = glm._dequantize_with(kernels, glm._row_range(part, start, tile))
                    out[:, start : start + weight.shape[0]] = F.linear(xs[k], weight)

        runs: dict[str, Callable[[], None]] = {
            "gemm": run_gemm, "rows": run_rows, "float32": run_float, "dequant": run_dequant
        }  # fmt: skip
        best = dict.fromkeys(PATHS, float("inf"))
        for _ in range(rounds):
            for name in PATHS:
                started = clock()
                runs[name]()
                best[name] = min(best[name], clock() - started)
        ms = [f"{1000 * best[name]:.1f}" for name in PATHS]
        lines.append(
            f"| {fmt} | {rows} | {' | '.join(ms)} | {best['float32'] / best['gemm']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="2,8,32,128,512")
    parser.add_argument("--formats", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall-clock time, not CPU time")
    parser.add_argument("--level", help="build quant_gemm for this x86-64 level (x86-64-v3)")
    parser.add_argument("--avx-vnni", action="store_true", help="with --level: add AVX-VNNI")
    args = parser.parse_args()
    gemm = _gemm_for(args.level, args.avx_vnni)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    rows = [int(r) for r in args.rows.split(",")]
    what = "wall" if args.wall else "CPU"
    print(f"{args.threads} thread(s), best of {args.rounds}, ms of {what} time a layer")
    print(f"| format | rows | {' | '.join(PATHS)} | float32 / gemm |")
    print("|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        for line in measure(fmt, rows, args.rounds, clock, gemm):
            print(line, flush=True)


if __name__ == "__main__":
    main()
