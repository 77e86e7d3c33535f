"""Single-request latency: end-to-end time of one batch of ``--batch-size`` prompts.

Mirrors ``vllm bench latency``: warm-up iterations, then ``--iters`` timed runs of the
same batch; reports mean and percentiles of the end-to-end latency and the time per
output token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--output-json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from enginecore import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    try:
        vocab = len(llm.get_tokenizer())
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]}
            for _ in range(args.batch_size)
        ]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        for _ in range(args.warmup):
            llm.generate(prompts, params)
        latencies = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            latencies.append(time.perf_counter() - t0)
    finally:
        llm.shutdown()
    latencies.sort()
    result = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "mean_s": statistics.fmean(latencies),
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "ms_per_output_token": 1000 * statistics.fmean(latencies) / args.output_len,
    }
    print(
        f"latency over {args.iters} runs (batch {args.batch_size}, {args.input_len} in / "
        f"{args.output_len} out): mean {result['mean_s']:.3f} s, p50 {result['p50_s']:.3f} s, "
        f"p99 {result['p99_s']:.3f} s, {result['ms_per_output_token']:.2f} ms per output token"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
