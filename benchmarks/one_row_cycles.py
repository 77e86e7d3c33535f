"""The one-row block products (the batch-1 decode step's) of two source trees, in
core-clock ticks a call, alternated in one run: how much arithmetic each format's kernel
costs, apart from the memory it reads and from other programs on a shared machine.

Each tree's ``quant_kernels.c`` and ``kquant_kernels.c`` are compiled for ``--isa`` as
the fused decode step holds them (serial, the engine's flags, with the VNNI and GFNI the
engine adds on this CPU at its own level) into ``one_row_cycles.c``, which times
``--rounds`` passes over ``--copies`` weights of ``--out`` x ``--in`` (the default, about
0.6-1.2 MB, stays in a core's L2) and prints the fewest rdtsc ticks a call took; the trees
alternate ``--pairs`` times. With ``--callgrind`` each build's instructions a call are
counted too (valgrind has no AVX-512: the x86-64-v3 build only), a figure no load
changes.

    python benchmarks/one_row_cycles.py --against ../before [--isa x86-64-v3] [--callgrind]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from enginecore_cpu import cpu_kernels, quant_kernels

HERE = Path(__file__).resolve().parent
KERNELS = Path("builtin_cpu/enginecore_cpu")
FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0")


def _build(tree: Path, isa: str, into: Path) -> Path:
    """``tree``'s two block-kernel sources and the harness, one executable."""
    extra = quant_kernels._vnni() if isa == cpu_kernels.instruction_set() else None
    flags = [f for f in cpu_kernels.FLAGS if f not in ("-fopenmp", "-shared", "-fPIC")]
    flags += ["-fopenmp-simd", f"-march={isa}", *(extra[1] if extra else [])]
    into.mkdir(parents=True)
    objects = []
    for name in ("quant_kernels.c", "kquant_kernels.c"):
        for part in (name, "quant_simd.h"):
            shutil.copy(tree / KERNELS / part, into / part)
        objects.append(str(into / f"{name}.o"))
        subprocess.run(["gcc", *flags, "-c", str(into / name), "-o", objects[-1]], check=True)
    program = into / "one_row_cycles"
    harness = HERE / "one_row_cycles.c"
    subprocess.run(["gcc", *flags, str(harness), *objects, "-o", str(program), "-lm"], check=True)
    return program


def _ticks(program: Path, fmt: str, args: argparse.Namespace, rounds: int) -> tuple[float, int]:
    cmd = [str(program), fmt, str(args.out), str(args.inputs), str(args.copies), str(rounds)]
    ticks, nbytes = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return float(ticks), int(nbytes)


def _instructions(program: Path, fmt: str, args: argparse.Namespace) -> int:
    """Instructions a call: callgrind's totals of 3 and 1 passes, halved difference."""
    totals = []
    for rounds in (1, 3):
        cmd = [str(program), fmt, str(args.out), str(args.inputs), "1", str(rounds)]
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
            capture_output=True,
            text=True,
            check=True,
        )
        totals.append(int(re.search(r"Collected : (\d+)", done.stderr).group(1)))  # type: ignore[union-attr]
    return (totals[1] - totals[0]) // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, required=True, help="the other source tree")
    parser.add_argument("--isa", default=cpu_kernels.instruction_set())
    parser.add_argument("--out", type=int, default=512)
    parser.add_argument("--in", dest="inputs", type=int, default=2048)
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"before": args.against.resolve(), "after": HERE.parent}
        programs = {
            name: _build(tree, args.isa, Path(scratch) / name) for name, tree in trees.items()
        }
        print(f"{args.out} x {args.inputs}, one row, one thread, {args.isa}; fewest ticks a call")
        print("| format | MB a call | before, kticks | after, kticks | after / before |")
        print("|---|---|---|---|---|")
        for fmt in args.formats.split(","):
            seen: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(args.pairs):
                for name, program in programs.items():
                    ticks, nbytes = _ticks(program, fmt, args, args.rounds)
                    seen[name].append(ticks)
            b, a = (", ".join(f"{t / 1e3:.1f}" for t in seen[n]) for n in ("before", "after"))
            ratio = min(seen["after"]) / min(seen["before"])
            print(f"| {fmt} | {nbytes / 1e6:.2f} | {b} | {a} | {ratio:.2f} |")
        if args.callgrind:
            print("\n| format | before, instructions a call | after |\n|---|---|---|")
            for fmt in args.formats.split(","):
                counts = [_instructions(programs[n], fmt, args) for n in ("before", "after")]
                print(f"| {fmt} | {counts[0]:,} | {counts[1]:,} |")


if __name__ == "__main__":
    main()
