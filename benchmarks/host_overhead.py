"""Host time per decode step: the whole engine with a forward that costs almost nothing.

The real offline path (``LLM`` in-process: scheduler, ``uni`` executor, model runner,
sampler, ``update_from_output``, output processor with detokenization) on a random
Llama checkpoint of hidden size 64, one layer and a 1024-token vocabulary, so that what
is measured is the host's work around the model. N requests decode together; each row
is the median over the steady decode steps of milliseconds per step, and its parts:

- ``schedule``: ``scheduler.schedule()``
- ``prep``: the model runner's ``execute_model`` less the model's forward (request
  updates, input and attention-metadata preparation)
- ``forward``: the model's forward (or the backend's fused decode step) and LM head
- ``sample``: ``sample_tokens`` (sampling metadata, sampler, the device-to-host copy)
- ``update``: ``scheduler.update_from_output()``
- ``output``: the frontend's output processing (detokenization, request outputs)
- ``loop``: the step's wall time less the parts above (engine loop, thread hand-off);
  with async scheduling the worker's parts overlap the engine's, so it can be negative
- ``call``: of ``forward``, the fused decode step's foreign call alone (0 where the
  layers run); the rest of ``forward`` is Python around it and, with async scheduling,
  the worker waiting for the interpreter lock after it while the engine thread runs
- ``cpu``: the CPU time the whole process (every thread) spent in the step; on a busy
  machine it moves less than the wall time, which includes waiting for a core
- ``cpu10``: the 10th percentile of ``cpu`` over the steps: the step's cost when least
  disturbed by other processes (their cache misses and shared cores inflate the median)
- ``sync%``: with async scheduling, the share of the run's steps the engine ran the
  synchronous way, having measured it faster for that batch size
  (``enginecore.engine.overlap_choice``; not a time)

    python benchmarks/host_overhead.py [--sizes 1,16,64,256,512] [--steps 200]

To compare two versions of the code on a busy machine, give another checkout with
``--against`` (e.g. ``git worktree add ../main main``): each row then runs both versions
alternately, each run in a process of its own with that checkout's source roots first on
``PYTHONPATH``, ``--rounds`` times, and prints both with the ratio of their median steps.
Compare the ratio, not figures taken at different times.

    python benchmarks/host_overhead.py --against ../main --rounds 3

The engine picks its threads as it would for any offline ``LLM`` (a thread per core
this process may run on). ``--threads N`` pins them (``OMP_NUM_THREADS``), e.g. ``1`` for
the engine ``enginecore serve`` runs on a 2-core host, which keeps a core for the HTTP
server, or on a loaded host, where a team of OpenMP threads waits at every barrier for
whichever of its threads was preempted. The threads each run used are printed.

``--kv-cache-dtype`` keeps the KV cache in ``float16`` or ``bfloat16`` (``auto``: the
model's float32); ``--kv-cache-dtypes auto,float16`` compares them the same way, each row
alternating the dtypes in processes of their own:

    python benchmarks/host_overhead.py --sizes 256 --modes sync --kv-cache-dtypes auto,float16
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARTS = ("schedule", "prep", "forward", "sample", "update", "output")
CALL = "call"  # inside ``forward``: not one of the parts the step's wall time is cut into
COLUMNS = ("step", *PARTS, "loop", CALL, "cpu", "cpu10", "sync%", "threads")


def cell(column: str, value: float) -> str:
    return f"{value:>8.0f}" if column == "threads" else f"{value:>8.3f}"


def make_checkpoint(out_dir: str) -> str:
    """A random Llama: hidden 64, one layer, vocabulary 1024 (the forward is nearly free)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from enginecore.checkpoints import MAX_POSITIONS, make_tokenizer

    tokenizer = make_tokenizer(1024)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class Timers:
    """Seconds spent in each part during the current step (reset by the caller)."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys((*PARTS, CALL), 0.0)
        self.scheduled: list[Any] = []

    def wrap(self, part: str, fn: Callable[..., Any]) -> Any:
        return timed_into(self.spent, part, fn)


def timed_into(spent: dict[str, float], part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding the seconds each call takes to ``spent[part]``."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - t0

    return timed


def instrument(llm: Any, timers: Timers) -> None:
    engine = llm.engine_client.engine
    scheduler = engine.scheduler
    runner = engine.executor.worker.model_runner
    schedule = timers.wrap("schedule", scheduler.schedule)

    def record_schedule() -> Any:
        out = schedule()
        timers.scheduled.append(out)
        return out

    scheduler.schedule = record_schedule
    scheduler.update_from_output = timers.wrap("update", scheduler.update_from_output)
    runner.sample_tokens = timers.wrap("sample", runner.sample_tokens)
    # prep = execute_model - forward: time both, subtract when reporting.
    runner.execute_model = timers.wrap("prep", runner.execute_model)
    model = runner.model
    model.forward = timers.wrap("forward", model.forward)
    model.compute_logits = timers.wrap("forward", model.compute_logits)
    fused = getattr(runner, "fused_decode", None)  # a whole decode step in one call
    if fused is not None:
        fused.run = timers.wrap("forward", fused.run)
        # The step's library, shared by the runs of one process: wrap its function once.
        # A step still waiting for its library to compile (its source changed) has none:
        # the column stays at zero for that run.
        lib = getattr(fused, "lib", None)
        if lib is not None:
            call = getattr(lib.ecd_decode_step, "__wrapped__", lib.ecd_decode_step)
            lib.ecd_decode_step = timers.wrap(CALL, call)
    llm._process_step = timers.wrap("output", llm._process_step)


def run(
    model: str, num_reqs: int, steps: int, async_scheduling: bool, kv_cache_dtype: str = "auto"
) -> dict[str, float]:
    import torch

    from enginecore import LLM, SamplingParams

    warmup = 5
    llm = LLM(
        model,
        multiprocessing=False,
        async_scheduling=async_scheduling,
        max_num_seqs=max(num_reqs, 1),
        max_num_batched_tokens=max(2048, num_reqs * 16),
        max_model_len=256 + steps,
        log_stats_interval=0,
        # Room for every request's blocks many times over: a cache sized from free RAM
        # would only lengthen each run's start (the block pool lists every block).
        kv_cache_bytes=256 << 20,
        # Named only where set: a checkout from before the setting (--against) has no key.
        **({} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}),
    )
    try:
        timers = Timers()
        instrument(llm, timers)
        params = SamplingParams(max_tokens=warmup + steps, temperature=0.0, ignore_eos=True)
        for i in range(num_reqs):
            prompt = [(i * 31 + j) % 1000 + 3 for j in range(16)]
            request, text = llm.input_processor.process(
                f"r{i}", {"prompt_token_ids": prompt}, params
            )
            llm._add(request, text)
        rows: list[dict[str, float]] = []
        seen_decodes = 0
        while llm.output_processor.has_unfinished_requests():
            timers.spent.update(dict.fromkeys((*PARTS, CALL), 0.0))
            timers.scheduled.clear()
            c0, t0 = time.process_time(), time.perf_counter()
            engine_outputs = llm.engine_client.get_output()
            llm._process_step(engine_outputs)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
            full_decode = timers.scheduled and all(
                so.total_num_scheduled_tokens == num_reqs == len(so.num_scheduled_tokens)
                for so in timers.scheduled
            )
            if not full_decode or len(timers.scheduled) != 1:
                continue
            seen_decodes += 1
            if seen_decodes <= warmup:
                continue
            row = dict(timers.spent)
            row["prep"] -= row["forward"]
            row["loop"] = wall - sum(row[p] for p in PARTS)
            row["step"] = wall
            row["cpu"] = cpu
            rows.append(row)
        result = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
        result["cpu10"] = statistics.quantiles([r["cpu"] for r in rows], n=10)[0] * 1e3
        result["threads"] = torch.get_num_threads()  # the step's, as the worker set them
        engine = getattr(llm.engine_client, "engine", None)
        choice = getattr(engine, "overlap_choice", None)  # older code: none
        ways = choice.counts if choice is not None else {False: 0}
        result["sync%"] = (
            100.0 * ways[False] / max(1, sum(ways.values())) if async_scheduling else 0.0
        )
        return result
    finally:
        llm.shutdown()


def source_path(checkout: Path) -> str:
    """``PYTHONPATH`` putting ``checkout``'s source roots (``core/``, ``builtin_*/``) first."""
    roots = [checkout / "core", *sorted(checkout.glob("builtin_*"))]
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(r) for r in roots] + ([rest] if rest else []))


_Variant = tuple[str, Path, str]  # name, checkout, KV cache dtype


def run_in(
    checkout: Path, model: str, n: int, steps: int, mode: str, kv: str = "auto"
) -> dict[str, float]:
    """One :func:`run` in a fresh process importing ``checkout``'s code."""
    env = dict(os.environ, PYTHONPATH=source_path(checkout))
    cmd = [sys.executable, __file__, "--model", model, "--sizes", str(n), "--modes", mode]
    if kv != "auto":  # a checkout from before the flag takes the default only
        cmd += ["--kv-cache-dtype", kv]
    out = subprocess.run(
        [*cmd, "--steps", str(steps), "--json"], env=env, check=True, capture_output=True, text=True
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def in_turn(variants: list[_Variant], round_index: int) -> list[_Variant]:
    """The order a round runs ``variants`` in: reversed every other round, so that each
    runs first as often as last (at small step times, whether a run comes first or after
    another shows in its median beside the code's own difference)."""
    return variants if round_index % 2 == 0 else variants[::-1]


def compare(model: str, variants: list[_Variant], args: argparse.Namespace) -> None:
    """Each row's ``variants`` (name, checkout, KV cache dtype) run alternately, in turn
    (``in_turn``); the ratios are of the first one's median to the others'."""
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(
        f"{'mode':>6} {'reqs':>5} {'code':>7} " + " ".join(f"{c:>8}" for c in COLUMNS) + "   (ms)"
    )
    for n in (int(s) for s in args.sizes.split(",") if s):
        for mode in args.modes.split(","):
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}
            for i in range(args.rounds):
                for name, checkout, kv in in_turn(variants, i):
                    runs[name].append(run_in(checkout, model, n, args.steps, mode, kv))
            for name, rows in runs.items():
                med = {c: statistics.median(r.get(c, float("nan")) for r in rows) for c in COLUMNS}
                print(
                    f"{mode:>6} {n:>5} {name:>7} " + " ".join(cell(c, med[c]) for c in COLUMNS),
                    flush=True,
                )
            first = variants[0][0]
            for col in ("step", "cpu", "cpu10"):
                got = {k: [r[col] for r in v] for k, v in runs.items()}
                for name, _, _ in variants[1:]:
                    ratio = statistics.median(got[first]) / statistics.median(got[name])
                    rounds = "; ".join(
                        f"{k} {', '.join(f'{s:.2f}' for s in got[k])}" for k in (name, first)
                    )
                    print(
                        f"{'':>6} {'':>5} {col}: {name} {ratio:.2f}x as fast as {first} "
                        f"(ms per round: {rounds})",
                        flush=True,
                    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64,256,512")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", help="a checkpoint to use instead of the made one")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--against", type=Path, help="another checkout, run alternately")
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    parser.add_argument("--json", action="store_true", help="one size and mode: a JSON line")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, float16 or bfloat16")
    parser.add_argument("--kv-cache-dtypes", help="A,B: these KV cache dtypes, alternately")
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's own)")
    args = parser.parse_args()
    if args.threads is not None:  # before torch is imported here or in a run's process
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(tmp)
        if args.kv_cache_dtypes:
            kinds = args.kv_cache_dtypes.split(",")
            compare(model, [(kv, here, kv) for kv in kinds], args)
            return
        if args.against is not None:
            kv = args.kv_cache_dtype
            compare(model, [("against", args.against.resolve(), kv), ("this", here, kv)], args)
            return
        if args.json:
            r = run(model, int(args.sizes), args.steps, args.modes == "async", args.kv_cache_dtype)
            print(json.dumps(r))
            return
        print(f"{'mode':>6} {'reqs':>5} " + " ".join(f"{c:>8}" for c in COLUMNS) + "   (ms)")
        for n in (int(s) for s in args.sizes.split(",") if s):
            for mode in args.modes.split(","):
                r = run(model, n, args.steps, mode == "async", args.kv_cache_dtype)
                print(f"{mode:>6} {n:>5} " + " ".join(cell(c, r[c]) for c in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
