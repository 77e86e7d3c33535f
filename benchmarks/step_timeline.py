"""Where the engine's and the frontend's Python run while the worker runs a decode step.

One run of ``host_overhead.py``'s set-up (the real in-process ``LLM``, a random Llama of
hidden size 64, one layer, vocabulary 1024) with timers on one clock around the worker's
input preparation (``execute_model`` up to the forward), its forward and
``sample_tokens``, the engine thread's ``schedule`` and its update (``update_from_output``
and the step's stats), and the frontend's output processing. Prints microseconds per
steady decode step: each part, and how much of the engine's and the frontend's time fell
inside the worker's preparation, forward and sampling. With async scheduling the engine
thread works on batch N while the worker runs N+1, and all three threads share one
interpreter lock: work that lands in the worker's Python (its preparation) delays it.

    python benchmarks/step_timeline.py --sizes 1,64,256 --modes sync,async,overlap

Modes: ``sync``; ``async`` (async scheduling, each size run the faster way:
``enginecore.engine.overlap_choice``); ``overlap`` (async scheduling, every step
overlapped). After the timeline, each thread's CPU time, sleeps (voluntary context
switches: a wait on a lock, a condition or a queue) and preemptions per step.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import host_overhead

from enginecore.engine.overlap_choice import OverlapChoice

Interval = tuple[float, float]


class Timeline:
    """Named intervals, on one clock, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.intervals: dict[str, list[Interval]] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spans = self.intervals.setdefault(name, [])

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    spans.append((start, time.perf_counter()))

        return timed


def instrument(llm: Any, timeline: Timeline) -> None:
    engine = llm.engine_client.engine
    runner = engine.executor.worker.model_runner
    engine.scheduler.schedule = timeline.wrap("schedule", engine.scheduler.schedule)
    engine._update = timeline.wrap("update", engine._update)
    runner.execute_model = timeline.wrap("execute", runner.execute_model)
    runner.sample_tokens = timeline.wrap("sample", runner.sample_tokens)
    runner._run_forward = timeline.wrap("forward", runner._run_forward)
    # The CPU backend's fused decode step with its head runs without _run_forward.
    runner._run_fused_head = timeline.wrap("forward", runner._run_fused_head)
    llm._process_step = timeline.wrap("output", llm._process_step)


def thread_stats() -> dict[str, tuple[float, int, int]]:
    """Per thread of this process, by name: CPU seconds, voluntary and involuntary
    context switches (a voluntary one is a sleep: on a lock, a condition, a queue)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    stats: dict[str, tuple[float, int, int]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            on_cpu_ns = int((task / "schedstat").read_text().split()[0])
            status = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
            )
        except OSError:  # the thread ended
            continue
        name = names.get(int(task.name), "other")  # torch's and OpenMP's threads: other
        cpu = on_cpu_ns / 1e9
        old = stats.get(name, (0.0, 0, 0))
        stats[name] = (
            old[0] + cpu,
            old[1] + int(status["voluntary_ctxt_switches"]),
            old[2] + int(status["nonvoluntary_ctxt_switches"]),
        )
    return stats


class ThreadWindow:
    """:func:`thread_stats` before and after a window of ``steps`` engine steps that
    starts at the ``start``-th ``get_output``."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps, self.calls = start, steps, 0
        self.before: dict[str, tuple[float, int, int]] = {}
        self.after: dict[str, tuple[float, int, int]] = {}

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.start:
                self.before = thread_stats()
            elif self.calls == self.start + self.steps:
                self.after = thread_stats()
            return fn(*args, **kwargs)

        return counted

    def report(self) -> str:
        if not self.after:
            return "threads: the window did not end"
        parts = []
        for name, (cpu, vol, invol) in sorted(self.after.items()):
            cpu0, vol0, invol0 = self.before.get(name, (0.0, 0, 0))
            n = self.steps
            parts.append(
                f"{name} cpu {(cpu - cpu0) / n * 1e6:.0f} us, sleeps {(vol - vol0) / n:.1f}, "
                f"preempted {(invol - invol0) / n:.2f}"
            )
        return "threads per step: " + "; ".join(parts)


def _overlap(a: list[Interval], b: list[Interval]) -> float:
    total = 0.0
    for a0, a1 in a:
        for b0, b1 in b:
            total += max(0.0, min(a1, b1) - max(a0, b0))
    return total


def _within(spans: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [s for s in spans if s[0] >= lo and s[1] <= hi]


def report(timeline: Timeline, steps: int) -> str:
    """Microseconds per step over the last ``steps`` forwards."""
    forwards = timeline.intervals["forward"][-steps:]
    lo, hi = forwards[0][0], forwards[-1][1]
    spans = {k: _within(v, lo, hi) for k, v in timeline.intervals.items()}
    prep: list[Interval] = []  # execute_model less the forward inside it
    for e0, e1 in spans["execute"]:
        inner = [f for f in spans["forward"] if f[0] >= e0 and f[1] <= e1]
        prep += [(e0, inner[0][0]), (inner[0][1], e1)] if inner else [(e0, e1)]
    worker = {"prep": prep, "forward": spans["forward"], "sample": spans["sample"]}
    engine = spans["schedule"] + spans["update"]
    n = len(spans["forward"])

    def us(seconds: float) -> str:
        return f"{seconds / n * 1e6:.0f}"

    parts = [f"{k} {us(sum(b - a for a, b in v))}" for k, v in worker.items()]
    line = "worker: " + " / ".join(parts)
    for name, own in (("engine", engine), ("frontend", spans["output"])):
        inside = ", ".join(f"in {k} {us(_overlap(own, v))}" for k, v in worker.items())
        line += f" | {name}: {us(sum(b - a for a, b in own))} ({inside})"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,64,256")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--model", help="a checkpoint to use instead of the made one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or host_overhead.make_checkpoint(tmp)
        base_instrument = host_overhead.instrument
        for size in (int(s) for s in args.sizes.split(",") if s):
            for mode in args.modes.split(","):
                timeline = Timeline()

                window = ThreadWindow(start=10, steps=args.steps - 10)

                def both(
                    llm: Any,
                    timers: Any,
                    timeline: Timeline = timeline,
                    window: ThreadWindow = window,
                    mode: str = mode,
                ) -> None:
                    base_instrument(llm, timers)
                    instrument(llm, timeline)
                    client = llm.engine_client
                    client.get_output = window.wrap(client.get_output)
                    if mode == "overlap":  # async scheduling without the adaptive choice
                        client.engine.overlap_choice = OverlapChoice(adaptive=False)

                host_overhead.instrument = both
                result = host_overhead.run(model, size, args.steps, mode != "sync")
                print(
                    f"{mode:>7} {size:>4} step {result['step']:.3f} ms, "
                    f"sync way {result['sync%']:.0f}% | "
                    f"{report(timeline, args.steps)}  (us per step)\n    {window.report()}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
