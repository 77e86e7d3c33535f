"""``enginecore bench decode``: single-stream decode speed beside its read bound.

One prompt, greedy, EOS ignored. Each round serves a request of ``1 + output_len`` tokens
and times its ``output_len`` decode steps from its own token times, its first token (the
prefill's) to its last: nothing outside the request's decode (the prefill, the call
around it, a pause between requests) enters the figure. The decode speed is the median
over rounds. For a GGUF file the read bound (``weight_bound``: bytes read per token over
this machine's measured bandwidth) is printed beside it, with the fraction of it reached; its bytes are the
weights' and the K/V a step reads at the run's mean context (``--input-len`` plus half
the steps), shown apart, in the KV cache's dtype (``--kv-cache-dtype``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from enginecore.bench import weight_bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a GGUF file (bound reported) or a checkpoint directory")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64, help="decode steps timed a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="the KV cache's dtype (auto: float16 for a GGUF file, else --dtype's)",
    )
    parser.add_argument("--output-json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from enginecore import LLM, SamplingParams

    if args.output_len < 1 or args.rounds < 1 or args.input_len < 1:
        raise SystemExit("decode: --input-len, --output-len and --rounds must be at least 1")
    load_start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    load_s = time.perf_counter() - load_start
    try:
        vocab = len(llm.get_tokenizer())
        rng = random.Random(0)
        low = min(256, vocab // 2)
        prompt = {"prompt_token_ids": [rng.randrange(low, vocab) for _ in range(args.input_len)]}

        params = SamplingParams(max_tokens=1 + args.output_len, temperature=0.0, ignore_eos=True)

        def decode_seconds() -> float:
            (out,) = llm.generate([prompt], params)
            return out.metrics["e2e_latency"] - out.metrics["time_to_first_token"]

        decode_seconds()  # warm-up: first-use work stays out of the figures
        speeds = [args.output_len / decode_seconds() for _ in range(args.rounds)]
    finally:
        llm.shutdown()
    result: dict[str, Any] = {
        "model": args.model,
        "kv_cache_dtype": args.kv_cache_dtype,
        "load_s": load_s,
        "decode_tokens_per_s": statistics.median(speeds),
        "rounds": speeds,
    }
    line = f"decode {result['decode_tokens_per_s']:.1f} tok/s (load {load_s:.1f} s)"
    if str(args.model).endswith(".gguf"):
        context = weight_bound.mean_decode_context(args.input_len, args.output_len)
        bound = weight_bound.gguf_decode_bound(
            args.model,
            args.input_len,
            args.output_len,
            weight_bound.measured_read_bandwidth(),
            kv_itemsize=weight_bound.kv_itemsize(args.kv_cache_dtype),
        )
        fraction = result["decode_tokens_per_s"] / bound.tokens_per_s
        result |= {
            "bytes_per_token": bound.bytes_per_token,
            "weight_bytes_per_token": bound.weight_bytes,
            "kv_bytes_per_token": bound.kv_bytes,
            "mean_context": context,
            "bandwidth_bytes_per_s": bound.bandwidth,
            "bound_tokens_per_s": bound.tokens_per_s,
            "fraction_of_bound": fraction,
        }
        line += (
            f"; read bound {bound.tokens_per_s:.1f} tok/s "
            f"({bound.weight_bytes / 1e6:.1f} MB of weights + {bound.kv_bytes / 1e6:.1f} MB "
            f"of K/V at {context:.0f} positions a token, at {bound.bandwidth / 1e9:.1f} GB/s "
            f"measured): {100 * fraction:.0f}% of it"
        )
    print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
