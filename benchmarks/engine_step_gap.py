"""What lies between the fused decode step and a token, in the engine as users run it.

The engine runs in its own process (``LLM``'s default), serving one greedy request of a
``--context``-token prompt for ``--decode-len`` tokens, with the fused decode step
built with ``-DECD_PROFILE`` (installed in the engine process over ``collective_rpc``).
Prints, per token of that request:

- the time from one fused call's start to the next's, the call itself (its LM head and
  argmax inside) and the host time between calls (the engine's and the runner's Python);
- each step thread's time per kind of work and waiting for the next phase (medians over
  the tokens), beside the same step replayed ``--repeats`` times back to back at the
  middle of the decode (nothing else runs between replays): what the engine's
  surroundings add to the call itself;
- the CPU time a token of every thread of both processes that used any (the engine's
  and the frontend's Python beside the step's threads);
- the bytes a token reads: the layers' and head's weights, and the K/V decode attention
  reads at the decode's mean position (float32 mirror), and the rate of the call.

``--build=FLAGS`` (repeatable) adds builds of the step with extra compiler flags
(``-DECD_MIN_UNITS=4``, ``-DECD_SHARE_DIVISOR=2``, ``-DECD_SPIN_CYCLES=2000000``) whose
replays alternate with the plain build's, block by block, in the same process.

    python benchmarks/engine_step_gap.py [MODEL.gguf] [--decode-len 128] [--repeats 20]
        [--build=-DECD_MIN_UNITS=4 ...]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

PHASES = (  # ecd_decode_step's profile, per thread (decode_step.c's PH_*)
    "qkv",
    "attention",
    "o",
    "gate_up",
    "down",
    "serial",
    "waiting",
    "call",
    "head",
    "pick",
)
PROFILE_THREADS = 8  # ECD_PROFILE_THREADS


def install(worker: Any, flags: list[str], replay_at: int, repeats: int) -> int:
    """In the engine process: the profiling builds, and a wrapper around the fused step
    that records every call and, at position ``replay_at``, replays it. Its thread count."""
    import torch

    from enginecore_cpu import decode_step

    def load(extra: list[str], name: str) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(decode_step.build((name, ["-DECD_PROFILE", *extra]))))
        lib.ecd_decode_step.argtypes = decode_step._load().ecd_decode_step.argtypes
        lib.ecd_decode_step.restype = ctypes.c_int
        lib.ecd_profile_read.argtypes = [ctypes.c_void_p]
        return lib

    builds = {"plain": load([], "profile")}
    for i, flag in enumerate(flags):
        builds[flag] = load(flag.split(), f"profile-v{i}")
    step = worker.model_runner.fused_decode
    if step is None:
        raise RuntimeError("this model does not take the fused decode step")

    fused = step.run
    phases = (ctypes.c_double * (PROFILE_THREADS * len(PHASES)))()
    calls: list[tuple[float, float, list[float], bool]] = []
    replays: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in builds}

    def profiled(lib: ctypes.CDLL, *args: Any, **kwargs: Any) -> tuple[Any, float, list[float]]:
        step.use_library(lib)
        lib.ecd_profile_read(phases)  # cleared
        started = time.perf_counter()
        out = fused(*args, **kwargs)
        took = time.perf_counter() - started
        lib.ecd_profile_read(phases)
        return out, took, list(phases)

    def run(ids: Any, positions: Any, batch: Any, **kwargs: Any) -> Any:
        replayed = ids.shape[0] == 1 and int(positions[0]) == replay_at
        if replayed:
            for _ in range(2):  # a block of each build, alternating
                for name, lib in builds.items():
                    for _ in range(max(1, repeats // 2)):
                        _, took, spent = profiled(lib, ids, positions, batch, **kwargs)
                        replays[name].append((took, spent))
        started = time.perf_counter()
        out, _, spent = profiled(builds["plain"], ids, positions, batch, **kwargs)
        calls.append((started, time.perf_counter(), spent, replayed))
        return out

    step.run = run
    worker.step_gap = (calls, replays)
    return torch.get_num_threads()


def collect(worker: Any) -> Any:
    calls, replays = worker.step_gap
    return list(calls), {name: list(r) for name, r in replays.items()}


def thread_cpu() -> dict[tuple[int, int, str], float]:
    """CPU seconds of each thread of this process and its children."""
    me = psutil.Process()
    out: dict[tuple[int, int, str], float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            for t in proc.threads():
                try:
                    comm = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
                except OSError:
                    comm = "?"
                out[(proc.pid, t.id, comm)] = t.user_time + t.system_time
        except psutil.Error:
            continue
    return out


def bytes_per_token(path: str, mean_position: float) -> tuple[int, int]:
    """Weight bytes a decode step reads (layers and head, as ``single_stream.py`` counts
    them) and the K/V bytes decode attention reads at ``mean_position`` (float32)."""
    import gguf

    reader = gguf.GGUFReader(path)
    weights = 0
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    for t in reader.tensors:
        if (t.name.startswith("blk.") and len(t.shape) == 2) or t.name == head:
            weights += int(t.n_bytes)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    layers, heads = field("block_count"), field("attention.head_count")
    kv_heads, hidden = field("attention.head_count_kv"), field("embedding_length")
    kv = int(2 * layers * kv_heads * (hidden // heads) * 4 * mean_position)
    return weights, kv


def ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):7.2f} (best {1e3 * min(values):.2f})"


def per_thread(spent: list[list[float]], threads: int) -> list[str]:
    lines = []
    for t in range(threads):
        cells = [
            f"{name} {statistics.median(s[t * len(PHASES) + i] for s in spent) / 1e6:.2f}"
            for i, name in enumerate(PHASES)
            if name != "call" or t == 0
        ]
        lines.append(f"    thread {t}: " + ", ".join(cells) + " ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="a .gguf file (default: the demo model's)")
    parser.add_argument("--context", type=int, default=128, help="the prompt's tokens")
    parser.add_argument("--decode-len", type=int, default=128, help="tokens decoded")
    parser.add_argument("--repeats", type=int, default=20, help="replays of one step, a build")
    parser.add_argument(
        "--build", action="append", default=[], dest="flags",
        help="another build, with these compiler flags (--build=-DECD_MIN_UNITS=4)",
    )  # fmt: skip
    args = parser.parse_args()

    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import find_demo_gguf

    model = args.model or str(find_demo_gguf())
    llm = LLM(model, max_model_len=args.context + args.decode_len + 64)
    replay_at = args.context + args.decode_len // 2
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [7 + i for i in range(args.context)]}], warm,
                     use_tqdm=False)  # fmt: skip
        threads = llm.collective_rpc(install, args=(args.flags, replay_at, args.repeats))[0]
        params = SamplingParams(max_tokens=args.decode_len, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": [100 + i for i in range(args.context)]}
        before = thread_cpu()
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - started
        after = thread_cpu()
        calls, replays = llm.collective_rpc(collect)[0]
    finally:
        llm.shutdown()
    # intervals between consecutive calls, but not the one the replays ran in
    pairs = [(a, b) for a, b in itertools.pairwise(calls) if not b[3]]
    weights, kv = bytes_per_token(model, args.context + args.decode_len / 2)
    call = [c[1] - c[0] for c in calls]
    print(f"{model}: {len(calls)} decode calls, {threads} threads, context {args.context}")
    print(f"  token to token       {ms([b[0] - a[0] for a, b in pairs])} ms")
    print(f"  fused call (head in) {ms(call)} ms")
    print(f"  between calls        {ms([b[0] - a[1] for a, b in pairs])} ms")
    print(f"  the request          {args.decode_len / wall:7.2f} tok/s (prefill and replays in)")
    print(
        f"  bytes a token: weights {weights / 1e6:.0f} MB, K/V at the mean position "
        f"{kv / 1e6:.1f} MB; the call reads {(weights + kv) / statistics.median(call) / 1e9:.1f} "
        "GB/s (median)"
    )
    print("  in the decode, per call:")
    print("\n".join(per_thread([c[2] for c in calls], threads)))
    for name, runs in replays.items():
        print(f"  replayed at position {replay_at}, build {name}: {ms([r[0] for r in runs])} ms")
        print("\n".join(per_thread([r[1] for r in runs], threads)))
    tokens = args.decode_len
    print("  CPU time a token, by thread (the whole request, its prefill included):")
    used = sorted(after, key=lambda key: before.get(key, 0.0) - after[key])
    for key in used:
        spent = after[key] - before.get(key, 0.0)
        if spent > 0:
            print(f"    pid {key[0]} {key[2]:18s} {1e3 * spent / tokens:7.2f} ms")
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
