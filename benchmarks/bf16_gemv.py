"""bfloat16 projections on CPU: enginecore's AVX512-BF16 kernel against torch's bfloat16
``F.linear`` (oneDNN, AMX where the CPU has it) and float32 ``F.linear``, per row count.

    python benchmarks/bf16_gemv.py [--repeats 7] [--pool-mb 64] [--decode | --no-sweep]

Each case times one call per weight of a pool of copies (``--pool-mb`` of bfloat16, twice
that of float32) so that, as in a decode step, no call finds its weight in the core's own
caches;
the candidates alternate within every repeat and the best repeat is kept (the machine may
be shared). ``--decode`` adds whole-model lines for a random ``small`` Llama checkpoint:
single-stream decode tok/s in float32, in bfloat16 and in bfloat16 without the kernel,
and a bfloat16 prefill with the weights in the kernel's layout and in the one used
without it; ``--no-sweep`` prints only those.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F

from enginecore_cpu import bf16_gemv, cpu_kernels

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # [out, in]
ROWS = [1, 2, 4, 8, 16, 32]


def cpu_line() -> str:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    flags = set(cpu_kernels._cpu_signature().split())
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    load = "/".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"{name}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"{' + '.join(isa) or 'no bf16 instructions'}, torch {torch.__version__}, "
        f"load average {load}"
    )


def pool(shape: tuple[int, int], dtype: torch.dtype, megabytes: int, input_major: bool):
    count = max(5, megabytes * 2**20 // (shape[0] * shape[1] * 2))
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(count):
        w = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
        weights.append(w.t().contiguous().t() if input_major else w)
    return weights


def time_per_call(fn, weights: list[torch.Tensor]) -> float:
    """The median time of one call over the pool (robust to another process's burst)."""
    times = []
    for w in weights:
        start = time.perf_counter()
        fn(w)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def sweep(repeats: int, pool_mb: int) -> None:
    kernel = bf16_gemv.load()
    print(f"# {cpu_line()}")
    print(f"# pool {pool_mb} MB of bfloat16 weights per case, best of {repeats}, µs per call")
    print(
        "| out x in | rows | kernel | F.linear bf16 | F.linear bf16 (input-major) | F.linear fp32 |"
    )
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        row_major = pool(shape, torch.bfloat16, pool_mb, False)
        input_major = pool(shape, torch.bfloat16, pool_mb, True)
        wide = pool(shape, torch.float32, 2 * pool_mb, True)
        for rows in ROWS:
            x = torch.randn(rows, shape[1]).bfloat16()
            xf = x.float()
            cases = {
                "bf16 F.linear": (lambda w, x=x: F.linear(x, w), row_major),
                "bf16 F.linear input-major": (lambda w, x=x: F.linear(x, w), input_major),
                "fp32 F.linear": (lambda w, xf=xf: F.linear(xf, w), wide),
            }
            if kernel is not None:
                cases = {"kernel": (lambda w, x=x: kernel.linear(x, w), row_major), **cases}
            for fn, weights in cases.values():  # warm up (oneDNN primitives, page faults)
                fn(weights[0])
            best = {name: float("inf") for name in cases}
            for _ in range(repeats):
                for name, (fn, weights) in cases.items():
                    best[name] = min(best[name], time_per_call(fn, weights))
            cells = [f"{best[n] * 1e6:.0f}" if n in best else "-" for n in
                     ("kernel", "bf16 F.linear", "bf16 F.linear input-major", "fp32 F.linear")]  # fmt: skip
            print(f"| {shape[0]} x {shape[1]} | {rows} | " + " | ".join(cells) + " |", flush=True)
        del row_major, input_major, wide


def decode(repeats: int) -> None:
    """Engines run in this process (``multiprocessing=False``), so the bfloat16 engine
    runs with the kernel and, by setting its row limit to 0 around a call, without it."""
    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import make_random_checkpoint

    with tempfile.TemporaryDirectory() as root:
        path = make_random_checkpoint(f"{root}/small", arch="llama", size="small", seed=0)
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        prompt = [{"prompt_token_ids": list(range(1, 17))}]
        engines = {
            dtype: LLM(str(path), dtype=dtype, multiprocessing=False)
            for dtype in ("float32", "bfloat16")
        }
        runs = {
            "float32": (engines["float32"], bf16_gemv.KERNEL_MAX_ROWS),
            "bfloat16": (engines["bfloat16"], bf16_gemv.KERNEL_MAX_ROWS),
            "bfloat16 without the kernel": (engines["bfloat16"], 0),
        }
        best = dict.fromkeys(runs, 0.0)
        try:
            for llm in engines.values():
                llm.generate(prompt, params, use_tqdm=False)  # warm up
            for _ in range(repeats):
                for name, (llm, limit) in runs.items():
                    default, bf16_gemv.KERNEL_MAX_ROWS = bf16_gemv.KERNEL_MAX_ROWS, limit
                    start = time.perf_counter()
                    out = llm.generate(prompt, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    bf16_gemv.KERNEL_MAX_ROWS = default
                    best[name] = max(best[name], len(out[0].outputs[0].token_ids) / elapsed)
        finally:
            for llm in engines.values():
                llm.shutdown()
    figures = ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in best.items())
    print(f"decode, random `small` llama, 1 stream, 16-token prompt, 64 tokens: {figures}")


def prefill(repeats: int, tokens: int = 512) -> None:
    """A bfloat16 model keeps its weights row-major for the kernel where it has one, and
    input-major without it (as float32 ones): oneDNN's prefill GEMM over both layouts."""
    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import make_random_checkpoint

    with tempfile.TemporaryDirectory() as root:
        path = make_random_checkpoint(f"{root}/small", arch="llama", size="small", seed=0)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prompt = [{"prompt_token_ids": [1 + i % 500 for i in range(tokens)]}]
        kernel = bf16_gemv.load()
        row_major = LLM(str(path), dtype="bfloat16", multiprocessing=False, prefix_caching=False)
        bf16_gemv.library.loaded, bf16_gemv.library.failed = (
            None,
            True,
        )  # loads as without the kernel
        input_major = LLM(str(path), dtype="bfloat16", multiprocessing=False, prefix_caching=False)
        runs = {"row-major": (row_major, kernel), "input-major": (input_major, None)}
        best = dict.fromkeys(runs, float("inf"))
        try:
            for _ in range(repeats):
                for name, (llm, loaded) in runs.items():
                    bf16_gemv.library.loaded, bf16_gemv.library.failed = loaded, loaded is None
                    start = time.perf_counter()
                    llm.generate(prompt, params, use_tqdm=False)
                    best[name] = min(best[name], time.perf_counter() - start)
        finally:
            bf16_gemv.library.loaded, bf16_gemv.library.failed = kernel, kernel is None
            row_major.shutdown()
            input_major.shutdown()
    figures = ", ".join(f"weights {name} {t * 1e3:.0f} ms" for name, t in best.items())
    print(f"prefill, random `small` llama, bfloat16, {tokens} tokens: {figures}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pool-mb", type=int, default=64)
    parser.add_argument("--decode", action="store_true", help="add the whole-model line")
    parser.add_argument("--no-sweep", action="store_true", help="only the whole-model line")
    args = parser.parse_args()
    if not args.no_sweep:
        sweep(args.repeats, args.pool_mb)
    if args.decode or args.no_sweep:
        if args.no_sweep:
            print(f"# {cpu_line()}")
        decode(args.repeats)
        if bf16_gemv.load() is not None:
            prefill(args.repeats)


if __name__ == "__main__":
    main()
