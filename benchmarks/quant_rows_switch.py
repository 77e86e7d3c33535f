"""Where the ``gguf`` method should switch from its block kernels to the float32 copy:
every projection of a GGUF model (the demo's by default) multiplied by R activation rows
through the integer block kernels and through the packed float32 copy a many-row step
uses, alternating, inside the engine's worker (its threads), best of ``--rounds``.

    python benchmarks/quant_rows_switch.py [MODEL.gguf] [--rows 8,16,24,32,48,64]
"""

from __future__ import annotations

import argparse
import time

import torch


def measure(worker, rows_list: list[int], rounds: int) -> list[str]:
    from enginecore_cpu import quant_kernels
    from enginecore_cpu.linear_method import CpuPackedLinearMethod

    model = worker.model_runner.model
    kernels = quant_kernels.load()
    layers = [
        module
        for name, module in model.named_modules()
        if getattr(module, "gguf_blocks", None) and module.weight.numel() and "embed" not in name
    ]
    lines = []
    for rows in rows_list:
        inputs = {layer.input_size: torch.randn(rows, layer.input_size) for layer in layers}
        outputs = {id(layer): torch.empty(rows, layer.output_size) for layer in layers}

        def blocks(inputs: dict = inputs, outputs: dict = outputs) -> None:
            for layer in layers:
                out = outputs[id(layer)]
                for first, part in layer.gguf_blocks:
                    kernels.linear(inputs[layer.input_size], part, out[:, first:] if first else out)

        def floats(inputs: dict = inputs) -> None:
            for layer in layers:
                CpuPackedLinearMethod.apply(layer.linear_method, layer, inputs[layer.input_size])

        best = {"blocks": float("inf"), "float32": float("inf")}
        for _ in range(rounds):
            for name, run in (("blocks", blocks), ("float32", floats)):
                started = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - started)
        lines.append(
            f"| {rows} | {1000 * best['blocks']:.1f} | {1000 * best['float32']:.1f} | "
            f"{best['float32'] / best['blocks']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="a .gguf file (default: the demo model's)")
    parser.add_argument("--rows", default="8,16,24,32,48,64")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    from enginecore import LLM
    from enginecore.checkpoints import find_demo_gguf

    llm = LLM(model=args.model or str(find_demo_gguf()), max_model_len=1024)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        lines = llm.collective_rpc(lambda worker: measure(worker, rows, args.rounds))[0]
    finally:
        llm.shutdown()
    print(f"{len(lines)} row counts, best of {args.rounds}, ms for all projections")
    print("| rows | blocks | float32 copy | float32 / blocks |\n|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
