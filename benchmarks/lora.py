"""The cost of LoRA: throughput at 64 running requests with 0, 1, 4 and 16 distinct
rank-16 adapters against the base model alone, in one run.

    python benchmarks/lora.py [MODEL_DIR] --size small --rounds 2

Every configuration runs the same 64 greedy requests (prompt ``--prompt-len`` tokens,
``--max-tokens`` out) through ``LLM`` in-process; the configurations alternate within
each round and the median output tokens/s per configuration is reported with its ratio
to the base model (``enable_lora`` off). ``lora-0`` is LoRA enabled with no request
naming an adapter (what enabling costs); ``lora-N`` spreads the requests over N adapters
(all seven projections targeted, rank 16), with ``max_loras`` = N so each step holds
them all. MODEL_DIR defaults to a seeded random checkpoint of ``--size`` (needs
``peft`` for the adapters, as the test extra installs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile
import time

from enginecore import LLM, SamplingParams
from enginecore.bench.throughput import machine_line
from enginecore.checkpoints import make_random_checkpoint
from enginecore.lora import LoRARequest
from enginecore.lora.random_adapter import make_random_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_REQUESTS = 64


def run(model: str, adapters: list[LoRARequest] | None, prompts, max_tokens: int) -> float:
    """Output tokens/s of one configuration (None: LoRA off)."""
    lora = {}
    if adapters is not None:
        lora = {"enable_lora": True, "max_loras": max(1, len(adapters)), "max_lora_rank": 16}
    with LLM(
        model,
        dtype="float32",
        max_num_seqs=NUM_REQUESTS,
        multiprocessing=False,
        prefix_caching=False,
        **lora,
    ) as llm:
        per_prompt = [
            adapters[i % len(adapters)] if adapters else None for i in range(len(prompts))
        ]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(batch[:4], params, lora_request=per_prompt[:4], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(batch, params, lora_request=per_prompt, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="enginecore-lora-bench-"))
    model = args.model or str(make_random_checkpoint(work / "base", size=args.size))
    most = max(args.adapters)
    pool = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(make_random_adapter(model, work / f"a{i}", r=16, target_modules=TARGETS, seed=i)),
        )
        for i in range(most)
    ]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 8000) for _ in range(args.prompt_len)] for _ in range(NUM_REQUESTS)
    ]
    configs: dict[str, list[LoRARequest] | None] = {"base": None}
    configs.update({f"lora-{n}": pool[:n] for n in args.adapters})
    rates: dict[str, list[float]] = {name: [] for name in configs}
    print(machine_line())
    for round_no in range(args.rounds):
        for name, adapters in configs.items():
            rate = run(model, adapters, prompts, args.max_tokens)
            rates[name].append(rate)
            print(f"round {round_no + 1} {name:8s} {rate:9.1f} out tok/s", flush=True)
    base = statistics.median(rates["base"])
    print(f"\n{NUM_REQUESTS} requests, {args.prompt_len} prompt tokens, {args.max_tokens} out")
    print("| configuration | out tok/s (median) | vs base |\n|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {median / base:.2f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(rates, indent=2) + "\n")


if __name__ == "__main__":
    main()
