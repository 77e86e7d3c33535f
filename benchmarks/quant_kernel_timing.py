"""Time the ``gguf`` linear method's kernels at decode sizes, one weight per format,
against float32 on the de-quantized weight and torch's own weight-only int8 / int4 CPU
kernels.

Each format's weight (``--out`` x ``--in``, the inputs a multiple of 256 so every
format applies) is multiplied by ``--rows`` activation rows: by the integer kernels
(activations quantized to 8 bits, as the engine computes), by de-quantize + float32
GEMM (the path above ``DIRECT_MAX_ROWS`` where ``quant_gemm`` did not build), and by ``F.linear`` on the de-quantized
weight held in float32; torch's ``_weight_int8pack_mm`` (int8 per channel) and
``_weight_int4pack_mm_for_cpu`` (4-bit, groups of 32) run on the same shape. The
candidates run in turn, round after round (the machine may be shared), and each one's
median over the rounds is printed in microseconds.

    python benchmarks/quant_kernel_timing.py [--out 576 --in 1536 --rows 1 --rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from enginecore.layers.quantized import QuantizedTensor
from enginecore.testing import quantizers
from enginecore_cpu import gguf_linear_method, quant_kernels
from enginecore_cpu.gguf_linear_method import (
    blocks_linear,
    per_channel_q8,
    unpacked,
)

FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "INT4 groups (AWQ/GPTQ)", "int8")


def _part(weight: torch.Tensor, fmt: str):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if fmt == "int8":
        return per_channel_q8(weight)
    if fmt.startswith("INT4"):
        from enginecore_models.group_quant import GroupQuantConfig, iter_group_quantized

        q, scales, zeros = quantizers.quantize_groups(weight, 64, symmetric=False)
        parts = [(f"w.{k}", v) for k, v in quantizers.awq_tensors(q, scales, zeros).items()]
        ((_, tensor),) = iter_group_quantized(iter(parts), GroupQuantConfig("awq", 64, 0), True)
        return unpacked(tensor)
    if fmt.endswith("_K"):
        raw = quantizers.quantize_k(weight, fmt)
    else:
        raw = quantize(weight.numpy(), GGMLQuantizationType[fmt])
    data = torch.from_numpy(raw).reshape(weight.shape[0], -1)
    return unpacked(QuantizedTensor(data, fmt, tuple(weight.shape)))


def _alternate(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        for _ in range(5):
            fn()  # warm up
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=int, default=576)
    parser.add_argument("--in", dest="inputs", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(args.out, args.inputs) * 0.05
    x = torch.randn(args.rows, args.inputs)
    candidates: dict[str, Callable[[], object]] = {}
    dense = weight.clone()
    candidates["float32 F.linear (de-quantized weight)"] = lambda: F.linear(x, dense)
    for fmt in FORMATS:
        part = _part(weight, fmt)
        blocks = [(0, part)]
        candidates[f"{fmt} integer kernel"] = lambda b=blocks: blocks_linear(b, x)
        candidates[f"{fmt} de-quantize + GEMM"] = lambda b=blocks: _dequantize_gemm(b, x)
    w8 = torch.randint(-127, 128, weight.shape, dtype=torch.int8)
    s8 = torch.rand(args.out)
    candidates["torch _weight_int8pack_mm"] = lambda: torch._weight_int8pack_mm(x, w8, s8)
    w4 = torch._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, weight.shape, dtype=torch.int32), 2
    )
    sz = torch.rand(args.inputs // 32, args.out, 2)
    candidates["torch _weight_int4pack_mm_for_cpu (groups of 32)"] = lambda: (
        torch._weight_int4pack_mm_for_cpu(x, w4, 32, sz)
    )
    medians = _alternate(candidates, args.rounds)
    print(
        f"{args.out} x {args.inputs} weight, {args.rows} row(s), "
        f"{torch.get_num_threads()} threads, median of {args.rounds} alternating rounds"
    )
    print("| candidate | µs |\n|---|---|")
    for name, us in medians.items():
        print(f"| {name} | {us:.1f} |")


def _dequantize_gemm(blocks, x: torch.Tensor) -> torch.Tensor:
    kernels = quant_kernels.load()
    assert kernels is not None
    return torch.cat(
        [F.linear(x, gguf_linear_method._dequantize_with(kernels, part)) for _, part in blocks], 1
    )


if __name__ == "__main__":
    main()
