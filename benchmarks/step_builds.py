"""Builds of the fused decode step alternated on one replayed step, phase by phase.

Each VARIANT is ``NAME[@THREADS]=TREE[:FLAGS]``: the step's C sources of checkout
``TREE`` (``decode_step.c`` and the kernels it holds), built with ``-DECD_PROFILE`` and
``FLAGS`` (``-DECD_SHARE_DIVISOR=2``, ``-DPREFETCH_BYTES=8192``), run on ``THREADS``
threads (default: the engine's). The engine runs in this process;
one greedy request of ``--context`` prompt tokens is served, and its first decode step
is replayed, the builds taking turns (``--block`` replays of each, ``--rounds`` times),
with the head and argmax inside as the engine calls it. Between blocks, a plain read of
96 MiB on one thread and on two (``read_probe.c``) says what the cores read from memory
at that moment.

On a shared machine the wall clock of a whole step measures the other programs. A build
with the phase timeline (``ecd_profile_phases``) also reports, per kind of phase, the
median time of the phases in which the OS preempted no step thread, times the layers:
what the phases take when both threads run, and their sum, the step so made up. Reads
of the probe in which no thread was preempted are reported the same way.

    python benchmarks/step_builds.py MODEL.gguf before=../before after=. \\
        "after-div2=.:-DECD_SHARE_DIVISOR=2" "after@1=." [--block 4] [--rounds 8]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
STAGES = ("qkv", "attention", "o", "gate_up", "down", "head", "pick")
WINDOW = 96 << 20  # bytes a read of the probe takes: beyond the L3
WINDOWS = 8  # the probe's buffer, read window after window


def build_step(tree: Path, flags: list[str], name: str) -> ctypes.CDLL:
    """The profiling build of ``tree``'s step with ``flags``, loaded."""
    from enginecore_cpu import cpu_kernels, decode_step, quant_gemm

    root = tree / "builtin_cpu" / "enginecore_cpu"
    sources = ("cpu_kernels.c", "quant_kernels.c", "kquant_kernels.c", "quant_gemm.c")
    extra = ["-DECD_PROFILE", *flags]
    isa = quant_gemm.extra_isa()
    path = cpu_kernels.build(
        source=root / "decode_step.c",
        stem="enginecore_decode_step",
        extra_isa=(f"{isa[0]}-{name}", isa[1] + extra) if isa else (name, extra),
        serial_sources=tuple(root / source for source in sources),
    )
    lib = ctypes.CDLL(str(path))
    lib.ecd_decode_step.argtypes = decode_step._load().ecd_decode_step.argtypes
    lib.ecd_decode_step.restype = ctypes.c_int
    lib.ecd_profile_read.argtypes = [ctypes.c_void_p]
    if hasattr(lib, "ecd_profile_phases"):
        lib.ecd_profile_phases.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def build_probe(into: Path) -> ctypes.CDLL:
    library = into / "read_probe.so"
    flags = ["-O3", "-march=native", "-shared", "-fPIC"]
    subprocess.run(["gcc", *flags, str(HERE / "read_probe.c"), "-o", str(library)], check=True)
    probe = ctypes.CDLL(str(library))
    probe.erp_read.restype = ctypes.c_double
    probe.erp_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    return probe


def stage_of(phase: int, layer_phases: int) -> int:
    return phase % 5 if phase < layer_phases else 5 + phase - layer_phases


def report_timeline(name: str, timelines: list[tuple[list[float], list[int]]], layers: int) -> None:
    """Per kind of phase: the median of the phases no step thread was preempted in (and
    of all of them), times the layers; their sum."""
    clean: dict[int, list[float]] = {}
    every: dict[int, list[float]] = {}
    for close, preempted in timelines:
        for phase, switches in enumerate(preempted):
            stage = stage_of(phase, 5 * layers)
            took = (close[phase + 1] - close[phase]) / 1e6
            every.setdefault(stage, []).append(took)
            if switches == 0:
                clean.setdefault(stage, []).append(took)
    total, cells = 0.0, []
    for stage in sorted(every):
        times = layers if stage < 5 else 1
        kept = clean.get(stage, [])
        ms = times * statistics.median(kept) if kept else float("nan")
        total += ms
        cells.append(
            f"{STAGES[stage]} {ms:.2f} ({len(kept)}/{len(every[stage])} unpreempted; "
            f"all {times * statistics.median(every[stage]):.2f})"
        )
    print(f"{name:14s} step from its unpreempted phases: {total:.2f} ms")
    print("    " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a .gguf file")
    parser.add_argument("variants", nargs="+", help="NAME=TREE[:FLAGS]")
    parser.add_argument("--context", type=int, default=128, help="positions cached before")
    parser.add_argument("--block", type=int, default=4, help="replays of a build in a row")
    parser.add_argument("--rounds", type=int, default=8, help="turns of every build")
    args = parser.parse_args()
    import numpy as np
    import torch

    from enginecore import LLM, SamplingParams

    libs = {}
    threads_of: dict[str, int | None] = {}
    for i, spec in enumerate(args.variants):
        name, rest = spec.split("=", 1)
        tree, _, flags = rest.partition(":")
        libs[name] = build_step(Path(tree).resolve(), flags.split(), f"builds{i}")
        threads_of[name] = int(name.split("@")[1]) if "@" in name else None
    scratch = tempfile.TemporaryDirectory(prefix="read-probe-")
    probe = build_probe(Path(scratch.name))
    buffer = np.ones(WINDOWS * WINDOW // 4, dtype=np.float32)
    reads: dict[int, list[tuple[float, int]]] = {1: [], 2: []}
    switches = ctypes.c_int64()

    llm = LLM(args.model, multiprocessing=False, max_model_len=args.context + 64)
    calls: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
    timelines: dict[str, list[tuple[list[float], list[int]]]] = {name: [] for name in libs}
    layers = 0
    finished: list[bool] = []
    try:
        runner = llm.collective_rpc(lambda w: w)[0].model_runner
        step = runner.fused_decode
        if step is None:
            raise SystemExit("this model does not take the fused decode step")
        layers = len(runner.model.model.layers)
        phases = 5 * layers + 2
        close = (ctypes.c_double * (phases + 1))()
        preempted = (ctypes.c_int32 * phases)()
        profile = (ctypes.c_double * 80)()
        fused = step.run

        def replay(ids: Any, positions: Any, batch: Any, **wanted: Any) -> Any:
            if finished or int(positions[0]) != args.context:
                return fused(ids, positions, batch, **wanted)
            for lib in libs.values():  # each build's first calls (its pages, its team)
                step.use_library(lib)
                for _ in range(3):
                    fused(ids, positions, batch, head="tokens")
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    step.use_library(lib)
                    for _ in range(args.block):
                        lib.ecd_profile_read(profile)
                        started, cpu = time.perf_counter(), time.process_time()
                        fused(ids, positions, batch, threads=threads_of[name], head="tokens")
                        calls[name].append(
                            (time.perf_counter() - started, time.process_time() - cpu)
                        )
                        if hasattr(lib, "ecd_profile_phases"):
                            lib.ecd_profile_phases(close, preempted, phases)
                            timelines[name].append((list(close), list(preempted)))
                    for threads in (1, 2):
                        at = buffer.ctypes.data + (len(reads[threads]) % WINDOWS) * WINDOW
                        took = probe.erp_read(at, WINDOW, threads, ctypes.byref(switches))
                        reads[threads].append((WINDOW / took, switches.value))
            finished.append(True)
            return fused(ids, positions, batch, **wanted)

        step.run = replay
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": [100 + i % 20000 for i in range(args.context)]}
        llm.generate([prompt], params, use_tqdm=False)
        threads = torch.get_num_threads()
    finally:
        llm.shutdown()
        scratch.cleanup()
    print(
        f"{args.model}: one decode row from position {args.context}, {threads} threads, "
        f"{args.rounds} rounds of {args.block} replays a build"
    )
    for threads_read, rates in reads.items():
        kept = [rate for rate, switched in rates if switched == 0]
        median = f"{statistics.median(kept):.1f}" if kept else "-"
        print(
            f"read on {threads_read} thread(s): {len(kept)}/{len(rates)} unpreempted, "
            f"median {median} GB/s"
        )
    for name, spent in calls.items():
        wall = [1e3 * s[0] for s in spent]
        cpu = [1e3 * s[1] for s in spent]
        print(
            f"{name:14s} call median / best {statistics.median(wall):.2f} / {min(wall):.2f} ms, "
            f"CPU time median / best {statistics.median(cpu):.2f} / {min(cpu):.2f} ms"
        )
    for name, kept_timelines in timelines.items():
        if kept_timelines:
            report_timeline(name, kept_timelines, layers)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
