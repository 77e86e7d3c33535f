"""What a single-stream decode step of a GGUF model (the demo's by default) is made of.

The engine runs in this process (``multiprocessing=False``) with the fused decode step
built with ``-DECD_PROFILE``. One greedy request of a ``--context``-token prompt is
served; its first decode step is then run again ``--repeats`` times (it writes the same
K/V to the same places each time): the median and best time of the fused call, each
thread's time per kind of work (products, attention, the serial norms) and waiting for
the next phase, summed over the layers, per call; the process's CPU time a call (all
threads: on a shared machine it says what the step costs where the wall clock says
how long other programs held the cores); then the LM head (``compute_logits``)
on its output, wall-clock and CPU time; and, where the step computes the head itself,
the step with the head and argmax inside (``head="tokens"``, the plain greedy step)
against the step, ``compute_logits`` and the argmax after it. Threads as the engine picks them
(``--threads`` to set them); the kernels built for this CPU, or with ``--isa`` for
another x86-64 level (the AVX2 ones on an AVX-512 CPU). Run under another ``PYTHONPATH`` to time another build of the step.

    python benchmarks/decode_step_phases.py [MODEL.gguf] [--context 128] [--threads N]
        [--isa x86-64-v3] [--requests N]

``--requests N`` serves N such requests and replays the first step where all N decode
together (any model the step takes: the float32 checkpoint of ``host_overhead.py`` at
256 requests times the step, head and argmax of a large batch).

``--cold`` writes 48 MB before each replay of the step, so that its K/V, weights and
scratch come from memory as they do in the engine, whose Python runs between steps (a
replay right after the last one finds them in the caches); its phases are then the
medians per call (the profile read after each call), not the means.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from typing import Any

PHASES = (  # ecd_decode_step's profile, per thread
    "qkv",
    "rotary, K/V append, attention",
    "o",
    "gate_up, silu",
    "down",
    "serial (norms, paged K/V write)",
    "waiting for the next phase",
    "whole call",
    "LM head (in the call)",
    "argmax pick (in the call)",
)
PROFILE_THREADS = 8  # ECD_PROFILE_THREADS


def _profiled_library() -> ctypes.CDLL:
    from enginecore_cpu import decode_step

    try:
        path = decode_step.build(("profile", ["-DECD_PROFILE"]))
    except TypeError:  # a build before the profile switch (comparing against one)
        path = decode_step.build()
    lib = ctypes.CDLL(str(path))
    lib.ecd_decode_step.argtypes = decode_step._load().ecd_decode_step.argtypes
    lib.ecd_decode_step.restype = ctypes.c_int
    if hasattr(lib, "ecd_profile_read"):
        lib.ecd_profile_read.argtypes = [ctypes.c_void_p]
    decode_step._lib = lib  # the engine's fused step loads this build
    return lib


def path_of(lib: ctypes.CDLL) -> str:
    return os.path.basename(lib._name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="a .gguf file (default: the demo model's)")
    parser.add_argument("--context", type=int, default=128, help="positions cached before")
    parser.add_argument("--repeats", type=int, default=200, help="replays of the step")
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's)")
    parser.add_argument("--requests", type=int, default=1, help="requests decoding together")
    parser.add_argument(
        "--isa", help="build the kernels for this x86-64 level (x86-64-v3: the AVX2 variants)"
    )
    parser.add_argument("--cold", action="store_true", help="caches flushed before each replay")
    args = parser.parse_args()

    if args.threads:  # before torch is imported and starts its team; the engine keeps it
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.isa:  # every library the engine builds, for that level (docs/quantization.md)
        os.environ["ENGINECORE_CPU_ISA"] = args.isa
    import numpy as np
    import torch

    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import find_demo_gguf

    # --cold: written before each replay, more than the caches hold
    flush = np.ones(48 << 18, dtype=np.float32) if args.cold else None
    lib = _profiled_library()
    profile = getattr(lib, "ecd_profile_read", lambda phases: None)
    model = args.model or str(find_demo_gguf())
    llm = LLM(
        model,
        multiprocessing=False,
        max_model_len=args.context + 64,
        max_num_seqs=max(args.requests, 1),
        max_num_batched_tokens=max(2048, args.context * args.requests),
    )
    report: list[str] = []
    try:
        worker = llm.collective_rpc(lambda w: w)[0]
        runner = worker.model_runner
        step = runner.fused_decode
        if step is None:
            raise SystemExit("this model does not take the fused decode step")
        fused_run = step.run
        phases = (ctypes.c_double * (PROFILE_THREADS * len(PHASES)))()

        def replay(ids: Any, positions: Any, batch: Any, **wanted: Any) -> Any:
            """At the context asked for, the same step again and again (it writes the
            same K/V to the same places each time), then the LM head on its output."""
            single = args.requests == 1
            if report or (single and int(positions[0]) != args.context):
                return fused_run(ids, positions, batch, **wanted)
            if ids.shape[0] != args.requests:
                return fused_run(ids, positions, batch, **wanted)
            hidden = fused_run(ids, positions, batch)
            for _ in range(10):
                fused_run(ids, positions, batch)
            profile(phases)
            times, cpu_times = [], []
            per_call: list[list[float]] = []  # --cold: each call's profile
            for _ in range(args.repeats):
                if flush is not None:
                    np.add(flush, 1.0, out=flush)
                started, cpu_started = time.perf_counter(), time.process_time()
                fused_run(ids, positions, batch)
                times.append(time.perf_counter() - started)
                cpu_times.append(time.process_time() - cpu_started)
                if flush is not None:
                    profile(phases)
                    per_call.append(list(phases))
            if per_call:  # medians per call, scaled as the sums below are
                for i in range(len(phases)):
                    phases[i] = args.repeats * statistics.median(c[i] for c in per_call)
            else:
                profile(phases)
            head, head_cpu = [], []
            for _ in range(max(10, args.repeats // 2)):
                started, cpu_started = time.perf_counter(), time.process_time()
                runner.model.compute_logits(hidden)
                head.append(time.perf_counter() - started)
                head_cpu.append(time.process_time() - cpu_started)
            n = args.repeats
            report.append(
                f"{'fused step (median / best)':40s} "
                f"{1e3 * statistics.median(times):8.3f} / {1e3 * min(times):.3f} ms"
            )
            report.append(
                f"{'CPU time, all threads (median / best)':40s} "
                f"{1e3 * statistics.median(cpu_times):8.3f} / {1e3 * min(cpu_times):.3f} ms"
            )
            threads = torch.get_num_threads()
            for i, name in enumerate(PHASES):
                per_thread = [phases[t * len(PHASES) + i] / 1e6 / n for t in range(threads)]
                cells = " ".join(f"{ms:8.3f}" for ms in per_thread)
                report.append(f"  {name:38s} {cells} ms")
            report.append(
                f"{'LM head (median / best)':40s} "
                f"{1e3 * statistics.median(head):8.3f} / {1e3 * min(head):.3f} ms"
            )
            report.append(
                f"{'LM head CPU time (median / best)':40s} "
                f"{1e3 * statistics.median(head_cpu):8.3f} / {1e3 * min(head_cpu):.3f} ms"
            )
            if getattr(step, "has_head", False):
                inside, outside = [], []
                for _ in range(args.repeats):  # alternately, the same inputs
                    started = time.perf_counter()
                    fused_run(ids, positions, batch, head="tokens")
                    inside.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    logits = runner.model.compute_logits(fused_run(ids, positions, batch))
                    runner.sampler.greedy_tokens(logits)
                    outside.append(time.perf_counter() - started)
                profile(phases)  # cleared; then the head's phases in the call
                in_a_row = []  # no torch ops between the calls, as in the engine's steps
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    fused_run(ids, positions, batch, head="tokens")
                    in_a_row.append(time.perf_counter() - started)
                profile(phases)
                threads = torch.get_num_threads()
                for i in (len(PHASES) - 2, len(PHASES) - 1):
                    per_thread = [phases[t * len(PHASES) + i] / 1e6 / n for t in range(threads)]
                    cells = " ".join(f"{ms:8.3f}" for ms in per_thread)
                    report.append(f"  {PHASES[i]:38s} {cells} ms")
                for name, spent in (
                    ("step, head and argmax inside", inside),
                    ("step, then head and argmax", outside),
                    ("the first, one call after another", in_a_row),
                ):
                    report.append(
                        f"{name + ' (median / best)':40s} "
                        f"{1e3 * statistics.median(spent):8.3f} / {1e3 * min(spent):.3f} ms"
                    )
            return fused_run(ids, positions, batch, **wanted)

        step.run = replay
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": [100 + i % 20000 for i in range(args.context)]}
        llm.generate([prompt] * args.requests, params, use_tqdm=False)
        if not report:
            raise SystemExit("no fused step ran at that context")
        threads = torch.get_num_threads()
        print(
            f"{model}: {args.requests} decode rows from position {args.context}, {threads} threads, "
            f"{args.repeats} replays{', cold' if args.cold else ''}, {path_of(lib)}"
        )
        print("\n".join(report))
    finally:
        llm.shutdown()
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
