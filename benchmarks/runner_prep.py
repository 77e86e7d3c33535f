"""The model runner's input preparation per decode step, and what it is made of.

The checkpoint and engine of ``host_overhead.py`` (hidden 64, one layer, vocabulary
1024; ``LLM`` in-process) with N requests decoding together; for every steady decode
step, the wall time of ``execute_model`` less the forward (the fused decode call or the
layers, and the LM head): ``prep``. Its parts are timed by wrappers around the
persistent batch's and the backend's calls: ``plan`` (the backend's ``order_decodes``),
``stage`` (the staged inputs), the rest. Medians and 10th percentiles in milliseconds,
and how many steps took the steady-decode path.

    python benchmarks/runner_prep.py [--sizes 256] [--steps 300] [--modes sync,async]

Under async scheduling the runner's thread shares the interpreter lock with the engine's:
a step that gives the lock up before its forward waits while the engine's thread runs,
and that wait is in ``prep``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_overhead import make_checkpoint, timed_into


def run(model: str, n: int, steps: int, async_scheduling: bool) -> dict[str, float]:
    from enginecore import LLM, SamplingParams

    llm = LLM(
        model,
        multiprocessing=False,
        async_scheduling=async_scheduling,
        max_num_seqs=n,
        max_num_batched_tokens=max(2048, n * 16),
        max_model_len=256 + steps,
        log_stats_interval=0,
        kv_cache_bytes=256 << 20,
    )
    try:
        runner = llm.engine_client.engine.executor.worker.model_runner
        spent = dict.fromkeys(("forward", "plan", "stage"), 0.0)
        fused = runner.fused_decode
        if fused is not None:
            fused.run = timed_into(spent, "forward", fused.run)
        runner.model.forward = timed_into(spent, "forward", runner.model.forward)
        runner.model.compute_logits = timed_into(spent, "forward", runner.model.compute_logits)
        backend = runner.attn_backend
        backend.order_decodes = timed_into(spent, "plan", backend.order_decodes)
        runner._stage = timed_into(spent, "stage", runner._stage)
        execute = runner.execute_model
        rows: list[dict[str, float]] = []
        seen = [0]

        def execute_model(so: Any) -> Any:
            seen[0] += 1
            spent.update(dict.fromkeys(spent, 0.0))
            t0 = time.perf_counter()
            out = execute(so)
            wall = time.perf_counter() - t0
            steady = so.total_num_scheduled_tokens == n == len(so.num_scheduled_tokens)
            if steady and seen[0] > 10:
                prep = wall - spent["forward"]
                rows.append(
                    {
                        "prep": prep,
                        "plan": spent["plan"],
                        "stage": spent["stage"],
                        "rest": prep - spent["plan"] - spent["stage"],
                    }
                )
            return out

        runner.execute_model = execute_model
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        for i in range(n):
            prompt = [(i * 31 + j) % 1000 + 3 for j in range(16)]
            request, text = llm.input_processor.process(
                f"r{i}", {"prompt_token_ids": prompt}, params
            )
            llm._add(request, text)
        while llm.output_processor.has_unfinished_requests():
            llm._process_step(llm.engine_client.get_output())
        result = {}
        for key in rows[0]:
            values = [r[key] for r in rows]
            result[key] = statistics.median(values) * 1e3
            result[f"{key}_p10"] = statistics.quantiles(values, n=10)[0] * 1e3
        result["steady_steps"] = float(getattr(runner, "steady_decode_steps", 0))
        result["steps"] = float(len(rows))
        return result
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", default="sync,async")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(tmp)
        print("requests  mode   prep (p10)      plan (p10)      stage (p10)     rest   steady")
        for n in (int(s) for s in args.sizes.split(",")):
            for mode in args.modes.split(","):
                r = run(model, n, args.steps, mode == "async")
                print(
                    f"{n:8d}  {mode:5s}  {r['prep']:.3f} ({r['prep_p10']:.3f})  "
                    f"{r['plan']:.3f} ({r['plan_p10']:.3f})  "
                    f"{r['stage']:.3f} ({r['stage_p10']:.3f})  {r['rest']:.3f}  "
                    f"{int(r['steady_steps'])}/{int(r['steps'])}"
                )


if __name__ == "__main__":
    main()
