"""One user on a CPU: enginecore against llama.cpp on the same GGUF, alternating.

Per round: prefill time of a ``--prompt-len`` prompt (one output token), single-stream
decode tokens/s, and total output tokens/s with 1, 4, 16 and 64 concurrent requests of 32
tokens. Ours runs with the GGUF's blocks kept (``quantization=auto``, the ``gguf``
method) and, with ``--dequantized``, also de-quantized to float32 (``none``). llama.cpp
runs through ``--llama-python`` (a venv with llama-cpp-python) when given. Prints each
round, then the machine line (with its load average) and one markdown table of the
medians: enginecore against llama.cpp (x faster), and our decode step against its read
bound (the bytes a step reads over the bandwidth of a large torch copy: the weights', and
the K/V attention reads at the run's mean context, shown apart). ``--kv-cache-dtypes
auto,float32`` runs ours with each KV cache dtype (``auto``: float16 for a GGUF file, as
llama.cpp keeps its K/V), counting each one's K/V bytes in its bound.

The decode figure, for both sides alike, is ``decode_len - 1`` tokens over the time from
the request's first token to its last, within one request: the decode steps alone, with
no prefill subtracted. Ours takes both times from the request's metrics
(``e2e_latency - time_to_first_token``: when the frontend had its first and its last
token); llama.cpp's from its token stream (when ``generate`` yielded the first and the
last).

    python benchmarks/peers/single_stream.py [MODEL.gguf] [--llama-python PY] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from enginecore.bench import weight_bound

HERE = Path(__file__).parent


def bandwidth_gb_s() -> float:
    """Read + write bytes per second of a 512 MiB copy (best of 5)."""
    src = torch.ones(128 << 20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_step(path: str, quantized: bool) -> int:
    """Bytes of projection and head weights one decode step reads."""
    import gguf

    reader = gguf.GGUFReader(path)
    total = 0
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            total += int(t.n_bytes) if quantized else int(t.n_elements) * 4
        elif t.name in ("output.weight", "token_embd.weight") and (
            t.name == "output.weight" or not any(x.name == "output.weight" for x in reader.tensors)
        ):
            if not quantized:
                total += int(t.n_elements) * 4
            elif t.tensor_type.name in HEAD_FORMATS:  # the head reads the file's blocks
                total += int(t.n_bytes)
            else:  # a Q8_0 copy of its float table, float32 scales
                total += int(t.n_elements) * 36 // 32
    return int(total)


# The formats the ``gguf`` method multiplies in the file's blocks (the head among them).
HEAD_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def fresh_prompt(length: int, seed: int) -> list[int]:
    """Token ids of a prompt no earlier seed shares a block with."""
    return [(17 * i + 7919 * seed) % 20000 + 100 for i in range(length)]


def ours(
    path: str, quantization: str, prompt_len: int, decode_len: int, conc: list[int], kv: str
) -> dict:
    from enginecore import LLM, SamplingParams

    llm = LLM(model=path, quantization=quantization, max_model_len=1024, kv_cache_dtype=kv)
    try:
        runs = iter(range(1 << 30))

        def run(max_tokens: int, n: int = 1) -> tuple[float, list]:
            # Fresh prompts every run and request: the prefix cache must not answer a
            # prompt it has seen (llama.cpp is reset between its runs).
            prompts = [{"prompt_token_ids": fresh_prompt(prompt_len, next(runs))} for _ in range(n)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - started, outputs

        run(4)
        prefill, _ = run(1)
        _, (output,) = run(decode_len)
        assert len(output.outputs[0].token_ids) == decode_len
        first_to_last = output.metrics["e2e_latency"] - output.metrics["time_to_first_token"]
        result = {"prefill_s": prefill, "decode_tok_s": (decode_len - 1) / first_to_last}
        for c in conc:
            result[f"throughput_{c}"] = 32 * c / run(32, c)[0]
        return result
    finally:
        llm.shutdown()


def peer(python: str, path: str, prompt_len: int, decode_len: int, conc: list[int]) -> dict:
    """llama.cpp's figures; where its repacked weight layouts crash the process (a
    segmentation fault in some builds), again without them, saying so."""
    command = [python, str(HERE / "llamacpp_single_stream.py"), path,
               str(torch.get_num_threads()), str(prompt_len), str(decode_len),
               ",".join(map(str, conc))]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode < 0:
        print(f"llama.cpp died ({done.returncode}); again without weight repacking", flush=True)
        done = subprocess.run([*command, "no-repack"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="a .gguf file (default: the demo model's)")
    parser.add_argument("--llama-python", help="Python of a venv with llama-cpp-python")
    parser.add_argument("--dequantized", action="store_true", help="also ours in float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="ours with each: auto,float32")
    args = parser.parse_args()
    if args.model is None:
        from enginecore.checkpoints import find_demo_gguf

        args.model = str(find_demo_gguf())
    conc = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, list[dict]] = {}
    contenders = {}
    kv_itemsize: dict[str, int] = {}  # each of ours: bytes of its K/V elements
    for kv in args.kv_cache_dtypes.split(","):
        suffix = "" if kv == "auto" else f" {kv} K/V"
        methods = [("gguf", "auto"), *([("float32", "none")] if args.dequantized else [])]
        for label, quantization in methods:
            name = f"enginecore {label}{suffix}"
            kv_itemsize[name] = weight_bound.kv_itemsize(kv)
            contenders[name] = functools.partial(
                ours, args.model, quantization, args.prompt_len, args.decode_len, conc, kv
            )
    if args.llama_python:
        contenders["llama.cpp"] = lambda: peer(
            args.llama_python, args.model, args.prompt_len, args.decode_len, conc
        )
    print(machine_line(), flush=True)
    if args.llama_python:
        print(peer_build(args.llama_python), flush=True)
    for round_ in range(args.rounds):
        for name, fn in contenders.items():
            runs.setdefault(name, []).append(fn())
            print(f"round {round_} {name}: {json.dumps(runs[name][-1])}", flush=True)
    print(f"\n{machine_line()}")
    bw = bandwidth_gb_s()
    print(f"memory bandwidth (512 MiB torch copy, read + write): {bw:.1f} GB/s\n")
    medians = {
        name: {k: statistics.median(r[k] for r in results) for k in results[0]}
        for name, results in runs.items()
    }
    context = weight_bound.mean_decode_context(args.prompt_len, args.decode_len - 1)
    for line in table(medians, conc, args.model, bw, args.rounds, context, kv_itemsize):
        print(line)


def machine_line() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line),
        platform.processor(),
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    from enginecore_cpu import cpu_kernels

    return (
        f"machine: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
        f"load average {load}; enginecore's kernels for {cpu_kernels.instruction_set()} "
        f"(ENGINECORE_CPU_ISA), torch's {torch.backends.cpu.get_cpu_capability()}"
    )


def peer_build(python: str) -> str:
    """The instruction sets the peer's llama.cpp was built with (its system info)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return f"llama.cpp: {done.stdout.strip() or done.stderr.strip()[-300:]}"


def table(
    medians: dict[str, dict[str, float]],
    conc: list[int],
    model: str,
    bw: float,
    rounds: int,
    context: float,
    kv_itemsize: dict[str, int],
) -> list[str]:
    """The medians as a markdown table, with enginecore's blocks against llama.cpp (x
    faster) and each of ours' decode step against the read bound: the weights' bytes and
    the K/V's (``kv_itemsize[name]`` bytes an element) at the mean ``context``, shown
    apart."""
    names = list(medians)
    ratio = "enginecore gguf" in medians and "llama.cpp" in medians
    head = "| | " + " | ".join(names) + (" | gguf vs llama.cpp |" if ratio else " |")
    lines = [f"medians of {rounds} rounds", "", head, "|---" * (len(names) + 1 + ratio) + "|"]

    def row(label: str, values: dict[str, str], speedup: float | None) -> None:
        cells = [values.get(name, "") for name in names]
        extra = [f"{speedup:.2f}x" if speedup else ""] if ratio else []
        lines.append("| " + " | ".join([label, *cells, *extra]) + " |")

    def speedup(key: str, higher_is_better: bool) -> float | None:
        if not ratio:
            return None
        ours, peer = medians["enginecore gguf"][key], medians["llama.cpp"][key]
        return ours / peer if higher_is_better else peer / ours

    row(
        "prefill, ms",
        {n: f"{1000 * m['prefill_s']:.0f}" for n, m in medians.items()},
        speedup("prefill_s", False),
    )
    row(
        "single-stream decode, tok/s",
        {n: f"{m['decode_tok_s']:.1f}" for n, m in medians.items()},
        speedup("decode_tok_s", True),
    )
    bounds = {}
    for name, m in medians.items():
        step = 1000 / m["decode_tok_s"]
        if name.startswith("enginecore"):
            kv = weight_bound.gguf_kv_bytes_per_token(model, context, kv_itemsize[name])
            weights = weight_bytes_per_step(model, quantized="gguf" in name)
            bound = 1000 * (weights + kv) / (bw * 1e9)
            bounds[name] = (
                f"{step:.1f} / {bound:.1f} ({weights / 1e6:.0f} MB weights "
                f"+ {kv / 1e6:.0f} MB K/V at {context:.0f} positions)"
            )
        else:
            bounds[name] = f"{step:.1f}"
    row("decode step / read bound, ms", bounds, None)
    for c in conc:
        key = f"throughput_{c}"
        row(
            f"{c} concurrent, total tok/s",
            {n: f"{m[key]:.1f}" for n, m in medians.items()},
            speedup(key, True),
        )
    return lines


if __name__ == "__main__":
    main()
