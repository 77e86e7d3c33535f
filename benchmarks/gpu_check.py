"""The GPU check: one command, under 8 minutes on one GPU, that says whether the GPU path
is right and how fast it is.

    python benchmarks/gpu_check.py [--out results.json] [--quick]

1. Greedy parity with transformers ``generate`` on random ``tiny`` and ``small`` Llama
   checkpoints, float32 and bfloat16, through the ``triton`` and ``torch`` backends, in one
   mixed batch (prompts of 5 to 300 tokens, chunked prefill and prefix caching on).
2. ``triton`` against ``torch`` on the same batches (token agreement).
3. Throughput, N=256 prompts x 128 in / 128 out, against transformers ``generate``
   (one padded batch) on the same GPU, bfloat16.
4. Decode step time at batch 1, 64 and 256 (``small``, bfloat16, 512-token contexts)
   against the bound set by the bytes read per step (weights + the KV read) over the
   GPU's measured copy bandwidth, with CUDA graphs and without (``enforce_eager``).
5. The ``gguf_triton`` block kernels (``builtin_gpu/enginecore_gpu/block_kernels.py``, also in ``--quick``):
   Q4_1, Q4_K-style (float32 scales) and Q8_0 blocks of a 4096 x 4096 weight, bf16
   activations of 1, 16 and 256 rows, against ``F.linear`` on the de-quantized bf16 weight
   (the largest difference, relative to the largest output) and timed against it: the
   kernel alone, and the method's path (the kernel up to ``FUSED_MAX_ROWS`` rows, a
   de-quantized copy and ``F.linear`` above). Then the ``tiny`` checkpoint with
   ``quantization="int8"`` (which selects ``gguf_triton`` on CUDA), bf16, CUDA graphs on:
   the layers kept in blocks and greedy agreement with the float model.

Prints a Markdown report and writes the figures as JSON. Needs the wheels in
``benchmarks/gpu_requirements.txt`` on top of torch, triton and transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import random
import sys
import tempfile
import time
from typing import Any

import torch

DECODE_CONTEXT = 512
DECODE_STEPS = 64


def make_checkpoint(root: pathlib.Path, size: str) -> pathlib.Path:
    from enginecore.checkpoints import make_random_checkpoint

    return make_random_checkpoint(root / f"llama-{size}", "llama", size)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 17, 64, 300, 33, 128, 7, 250][:n]
    shared = [rng.randrange(3, 8000) for _ in range(48)]  # a common prefix: cache hits
    out = []
    for i, length in enumerate(lengths):
        tail = [rng.randrange(3, 8000) for _ in range(length)]
        out.append(shared + tail if i % 2 else tail)
    return out


def hf_greedy(path: pathlib.Path, prompts: list[list[int]], dtype: torch.dtype, n: int) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the reference
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
            outs.append(gen[0, len(p) :].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def ours_greedy(
    path: pathlib.Path, prompts: list[list[int]], dtype: str, backend: str, n: int
) -> list:
    from enginecore import LLM, SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(
        str(path),
        dtype=dtype,
        attention_backend=backend,
        max_num_batched_tokens=256,  # prompts of 300 tokens are chunked
        gpu_memory_utilization=0.3,
        multiprocessing=False,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def parity(root: pathlib.Path, sizes: list[str], report: dict[str, Any]) -> None:
    prompts = mixed_prompts(8)
    n = 24
    for size in sizes:
        path = make_checkpoint(root, size)
        for dtype, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            want = hf_greedy(path, prompts, tdtype, n)
            got = {b: ours_greedy(path, prompts, dtype, b, n) for b in ("triton", "torch")}
            for backend, outs in got.items():
                diffs = [first_difference(o, w) for o, w in zip(outs, want, strict=True)]
                report["parity"].append(
                    {
                        "size": size,
                        "dtype": dtype,
                        "backend": backend,
                        "equal": sum(d is None for d in diffs),
                        "of": len(diffs),
                        "first_difference": diffs,
                    }
                )
            agree = sum(a == b for a, b in zip(got["triton"], got["torch"], strict=True))
            report["triton_vs_torch"].append(
                {"size": size, "dtype": dtype, "equal": agree, "of": len(prompts)}
            )


def throughput(root: pathlib.Path, report: dict[str, Any], num: int) -> None:
    from transformers import AutoModelForCausalLM

    from enginecore import LLM, SamplingParams

    path = make_checkpoint(root, "small")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 8000) for _ in range(128)] for _ in range(num)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", max_num_seqs=256, multiprocessing=False) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4))
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ours = time.perf_counter() - start
    gc.collect()
    torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            ids,
            max_new_tokens=128,
            min_new_tokens=128,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
        )
        torch.cuda.synchronize()
        hf = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    tokens = num * 128
    report["throughput"] = {
        "prompts": num,
        "ours_tok_s": tokens / ours,
        "transformers_tok_s": tokens / hf,
        "ratio": hf / ours,
    }


def _weight_bytes(worker: Any) -> int:
    model = worker.model_runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 4 / (time.perf_counter() - start)


def decode_steps(root: pathlib.Path, report: dict[str, Any], batches: list[int]) -> None:
    from enginecore import LLM, SamplingParams

    path = make_checkpoint(root, "small")
    bandwidth = copy_bandwidth()
    rng = random.Random(2)
    rows = []
    for eager in (False, True):
        with LLM(
            str(path),
            dtype="bfloat16",
            max_num_seqs=max(batches),
            enforce_eager=eager,
            block_size=16,
            multiprocessing=False,
        ) as llm:
            weight_bytes = llm.collective_rpc(_weight_bytes)[0]
            block_bytes = llm.collective_rpc("get_kv_cache_block_bytes")[0]
            block = 16
            for batch in batches:
                prompts = [
                    {"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(DECODE_CONTEXT)]}
                    for _ in range(batch)
                ]
                times = {}
                for steps in (1, DECODE_STEPS + 1):
                    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
                    llm.reset_prefix_cache()
                    start = time.perf_counter()
                    llm.generate(prompts, params)
                    times[steps] = time.perf_counter() - start
                step = (times[DECODE_STEPS + 1] - times[1]) / DECODE_STEPS
                kv_read = batch * (DECODE_CONTEXT + DECODE_STEPS / 2) * block_bytes / block
                bound = (weight_bytes + kv_read) / (bandwidth / 2)  # bandwidth counts R + W
                rows.append(
                    {
                        "batch": batch,
                        "cuda_graphs": not eager,
                        "step_ms": step * 1e3,
                        "bound_ms": bound * 1e3,
                        "of_bound": bound / step if step > 0 else None,
                    }
                )
        gc.collect()
        torch.cuda.empty_cache()
    report["decode"] = {"copy_bandwidth_gb_s": bandwidth / 1e9, "rows": rows}


def random_blocks(kind: str, n: int, k: int, device: str) -> Any:
    """A random weight [n, k] in the ``gguf_triton`` method's block layout."""
    from enginecore.block_formats.gguf_blocks import BlockWeight

    gen = torch.Generator(device=device).manual_seed(0)
    blocks = (n, k // 32)
    if kind == "Q8_0":
        qs = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
        d = torch.rand(blocks, generator=gen, device=device) / 127
        return BlockWeight(8, qs, d, torch.zeros_like(d), (n, k))
    scale_dtype = torch.float16 if kind == "Q4_1" else torch.float32
    qs = torch.randint(0, 256, (n, k // 32, 16), generator=gen, device=device, dtype=torch.uint8)
    d = (torch.rand(blocks, generator=gen, device=device) / 15).to(scale_dtype)
    m = (-8 * d.float()).to(scale_dtype)
    return BlockWeight(4, qs, d, m, (n, k))


def _time_us(fn: Any, device: str, reps: int) -> float:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps * 1e6


def block_linear(
    report: dict[str, Any],
    device: str = "cuda",
    shape: tuple[int, int] = (4096, 4096),
    row_counts: tuple[int, ...] = (1, 16, 256),
    reps: int = 50,
) -> None:
    import torch.nn.functional as F

    from enginecore_gpu import block_kernels
    from enginecore_gpu.block_linear_method import blocks_linear

    n, k = shape
    rows_out = []
    for kind in ("Q4_1", "Q4_K", "Q8_0"):
        part = random_blocks(kind, n, k, device)
        half = block_kernels.dequantize(part.bits, part.qs, part.d, part.m, torch.bfloat16)
        for rows in row_counts:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            got = block_kernels.block_linear(x, part.bits, part.qs, part.d, part.m)
            want = F.linear(x.float(), half.float())
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            rows_out.append(
                {
                    "format": kind,
                    "rows": rows,
                    "max_rel_diff": err,
                    "kernel_us": _time_us(
                        lambda x=x, p=part: block_kernels.block_linear(x, p.bits, p.qs, p.d, p.m),
                        device,
                        reps,
                    ),
                    "method_us": _time_us(
                        lambda x=x, p=part: blocks_linear([(0, p)], x), device, reps
                    ),
                    "f_linear_us": _time_us(lambda x=x, w=half: F.linear(x, w), device, reps),
                    "block_mb": part.nbytes / 1e6,
                }
            )
    report["block_linear"] = {"shape": list(shape), "rows": rows_out}


def _block_layers(worker: Any) -> list[str]:
    model = worker.model_runner.model
    return [type(m.linear_method).__name__ for m in model.modules() if hasattr(m, "gguf_blocks")]


def int8_model(root: pathlib.Path, report: dict[str, Any]) -> None:
    from enginecore import LLM, SamplingParams

    path = make_checkpoint(root, "tiny")
    prompts = mixed_prompts(8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs, methods = {}, []
    for quantization in ("int8", "none"):
        with LLM(
            str(path),
            dtype="bfloat16",
            quantization=quantization,
            gpu_memory_utilization=0.3,
            multiprocessing=False,
        ) as llm:
            if quantization == "int8":
                methods = llm.collective_rpc(_block_layers)[0]
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outs[quantization] = [o.outputs[0].token_ids for o in got]
        gc.collect()
        torch.cuda.empty_cache()
    diffs = [first_difference(a, b) for a, b in zip(outs["int8"], outs["none"], strict=True)]
    report["int8_model"] = {
        "layers_in_blocks": len(methods),
        "methods": sorted(set(methods)),
        "equal": sum(d is None for d in diffs),
        "of": len(diffs),
        "first_difference": diffs,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [f"GPU: {report['gpu']}; torch {report['torch']}", ""]
    lines += ["| size | dtype | backend | greedy = transformers |", "|---|---|---|---|"]
    for r in report["parity"]:
        lines.append(f"| {r['size']} | {r['dtype']} | {r['backend']} | {r['equal']}/{r['of']} |")
    lines += ["", "| size | dtype | triton = torch |", "|---|---|---|"]
    for r in report["triton_vs_torch"]:
        lines.append(f"| {r['size']} | {r['dtype']} | {r['equal']}/{r['of']} |")
    if "throughput" in report:
        t = report["throughput"]
        lines += [
            "",
            f"Throughput, {t['prompts']} x 128/128 (small, bf16): ours "
            f"{t['ours_tok_s']:.0f} tok/s, transformers {t['transformers_tok_s']:.0f} tok/s, "
            f"{t['ratio']:.2f}x",
        ]
    if "decode" in report:
        d = report["decode"]
        lines += [
            "",
            f"Decode steps (small, bf16, {DECODE_CONTEXT}-token contexts); copy bandwidth "
            f"{d['copy_bandwidth_gb_s']:.0f} GB/s",
            "",
            "| batch | CUDA graphs | step ms | bound ms | bound / step |",
            "|---:|---|---:|---:|---:|",
        ]
        for r in d["rows"]:
            share = f"{r['of_bound']:.2f}" if r["of_bound"] else "-"
            lines.append(
                f"| {r['batch']} | {'on' if r['cuda_graphs'] else 'off'} | "
                f"{r['step_ms']:.2f} | {r['bound_ms']:.3f} | {share} |"
            )
    if "block_linear" in report:
        b = report["block_linear"]
        n, k = b["shape"]
        lines += [
            "",
            f"gguf_triton block kernels, {n} x {k} weight, bf16 activations (µs a call):",
            "",
            "| format | rows | max rel. diff | kernel | method | F.linear (bf16 weight) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in b["rows"]:
            lines.append(
                f"| {r['format']} | {r['rows']} | {r['max_rel_diff']:.1e} | "
                f"{r['kernel_us']:.1f} | {r['method_us']:.1f} | {r['f_linear_us']:.1f} |"
            )
    if "int8_model" in report:
        m = report["int8_model"]
        lines += [
            "",
            f"tiny, int8 on CUDA: {m['layers_in_blocks']} layers in blocks ({m['methods']}); "
            f"greedy = bf16 model on {m['equal']}/{m['of']} prompts, first differences "
            f"{m['first_difference']}",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument(
        "--quick", action="store_true", help="tiny parity, the block kernels and int8 on tiny only"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "parity": [],
        "triton_vs_torch": [],
        "seconds": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        stages = [
            ("parity", lambda: parity(root, ["tiny"] if args.quick else ["tiny", "small"], report)),
            ("block_linear", lambda: block_linear(report)),
            ("int8_model", lambda: int8_model(root, report)),
        ]
        if not args.quick:
            stages += [
                ("throughput", lambda: throughput(root, report, 256)),
                ("decode", lambda: decode_steps(root, report, [1, 64, 256])),
            ]
        for name, stage in stages:
            start = time.perf_counter()
            try:
                stage()
            except Exception as exc:  # report what failed and go on to the next stage
                report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            report["seconds"][name] = round(time.perf_counter() - start, 1)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    for name, error in report.get("errors", {}).items():
        print(f"\n{name} failed: {error}", file=sys.stderr)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
