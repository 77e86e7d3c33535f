"""Run as ``python -m tests.helpers.fused_idle_cpu MODEL.gguf``: in a fresh process, as
an engine process runs it, the CPU seconds the fused decode step's other threads take in
the 50 ms after each of a request's first decode steps while the calling thread sleeps
(the engine's Python between steps), printed one a line."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any


def native_threads_cpu() -> dict[int, int]:
    """CPU nanoseconds of each of this process's threads that Python did not start (the
    step's team, OpenMP's, a library's), by thread id."""
    python = {t.native_id for t in threading.enumerate()}
    spent = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                if tid not in python:
                    spent[tid] = int(stat.read().split()[0])
        except OSError:  # ended meanwhile
            continue
    return spent


def idle_cpu_after(run: Any, *args: Any) -> float:
    """``run(*args)`` on two threads, then the CPU seconds those threads Python did not
    start take in the next 50 ms."""
    run(*args, threads=2)
    before = native_threads_cpu()
    time.sleep(0.05)
    after = native_threads_cpu()
    return sum(spent - before.get(tid, 0) for tid, spent in after.items()) / 1e9


def main(path: str) -> None:
    from enginecore import LLM, SamplingParams

    idle: list[float] = []
    with LLM(path, multiprocessing=False, max_model_len=128) as llm:
        step = llm.collective_rpc(lambda w: w.model_runner.fused_decode)[0]
        fused_run = step.run

        def measured(ids: Any, positions: Any, batch: Any, **head: Any) -> Any:
            if len(idle) < 3 and ids.shape[0] == 1:
                idle.append(idle_cpu_after(fused_run, ids, positions, batch))
            return fused_run(ids, positions, batch, **head)

        step.run = measured
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(3, 40))}], params, use_tqdm=False)
    print("\n".join(map(str, idle)))


if __name__ == "__main__":
    main(sys.argv[1])
