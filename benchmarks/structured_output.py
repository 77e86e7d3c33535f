"""Throughput with and without structured output (JSON schema), in one engine, one run.

    python benchmarks/structured_output.py MODEL_DIR [--batch 64] [--output-len 128] [--repeats 3]

Every request of the constrained batch carries a JSON schema whose output cannot end
before ``--output-len`` tokens (an array with more items than fit), so both batches
produce exactly ``batch x output_len`` tokens and the ratio is the cost of the
grammar: compiling is done once before timing (cache), then each step fills the batch
bitmask while the forward pass runs, masks the logits and advances 64 matchers.
Plain and constrained runs alternate, so load on a shared machine hits both alike;
tokens per CPU second of the (in-process) engine are reported too, as they move less
than wall-clock rates when other jobs compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from enginecore import LLM, SamplingParams, StructuredOutputParams
from enginecore.bench.throughput import machine_line

LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "ok": {"type": "boolean"},
                    "label": {"type": "string", "pattern": "^[a-z]{2,8}$"},
                },
                "required": ["id", "ok", "label"],
                "additionalProperties": False,
            },
            "minItems": 500,
        }
    },
    "required": ["readings"],
    "additionalProperties": False,
}


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(tokens per wall-clock second, tokens per CPU second of this process)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == len(prompts) * params.max_tokens, tokens  # both runs: same work
    return tokens / seconds, tokens / cpu_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    prompts = [
        [(7 * i + 13 * j) % 8000 + 100 for j in range(args.prompt_len)] for i in range(args.batch)
    ]
    plain = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len,
        temperature=0.0,
        structured_output=StructuredOutputParams(json=LONG_SCHEMA),
    )
    with LLM(
        args.model,
        dtype="float32",
        max_num_seqs=args.batch,
        async_scheduling=not args.no_async_scheduling,
        disable_any_whitespace=True,
        # In-process, so that this process's CPU time covers the engine's work too.
        multiprocessing=False,
    ) as llm:
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompts[0]}, constrained.clone(max_tokens=2))
        first = time.perf_counter() - start  # backend start-up + compile, once
        timed(llm, prompts, plain)  # warm-up
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for name, params in (("plain", plain), ("json_schema", constrained)):
                wall, cpu = timed(llm, prompts, params)
                runs.setdefault(name, []).append(wall)
                runs.setdefault(f"{name}_per_cpu_s", []).append(cpu)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    slowdown = 1 - medians["json_schema"] / medians["plain"]
    cpu_slowdown = 1 - medians["json_schema_per_cpu_s"] / medians["plain_per_cpu_s"]
    results = {
        "machine": machine_line(),
        "load_average": os.getloadavg(),
        "batch": args.batch,
        "output_len": args.output_len,
        "async_scheduling": not args.no_async_scheduling,
        "engine": "in-process (uni executor)",
        "first_request_seconds": round(first, 2),
        "tokens_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
        "slowdown": round(slowdown, 3),
        "slowdown_per_cpu_s": round(cpu_slowdown, 3),
    }
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
