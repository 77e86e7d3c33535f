"""Speculative decoding on a repetitive workload: n-gram drafting on vs off, in one run.

    python benchmarks/spec_decode.py [MODEL_DIR] --batch-sizes 1 8 --max-tokens 128

The workload is code editing: each prompt holds a Python function and asks for it back
with one change, so most of the answer copies the prompt (where prompt lookup hits).
Both configurations run the same requests (greedy) through the real engine core
in-process, one after the other, and the script checks that their outputs are identical.
For each batch size it reports engine steps (forward passes) and output tokens/s
without and with speculation (median of ``--repeats`` alternating passes), the ratio,
the draft acceptance rate and the mean accepted length (1 + accepted per verifying step).
MODEL_DIR defaults to the demo model (``enginecore demo-model``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

from enginecore import SamplingParams, make_config
from enginecore.bench.throughput import machine_line
from enginecore.engine.core import EngineCore
from enginecore.protocol import EngineCoreRequest

SNIPPETS = [
    (
        "def moving_average(values, window):\n"
        "    result = []\n"
        "    total = 0.0\n"
        "    for index, value in enumerate(values):\n"
        "        total += value\n"
        "        if index >= window:\n"
        "            total -= values[index - window]\n"
        "        if index >= window - 1:\n"
        "            result.append(total / window)\n"
        "    return result\n",
        "Rename the variable `total` to `running_sum`.",
    ),
    (
        "def parse_config(lines):\n"
        "    config = {}\n"
        "    for line in lines:\n"
        "        line = line.strip()\n"
        "        if not line or line.startswith('#'):\n"
        "            continue\n"
        "        key, value = line.split('=', 1)\n"
        "        config[key.strip()] = value.strip()\n"
        "    return config\n",
        "Add a docstring to the function.",
    ),
    (
        "class Stack:\n"
        "    def __init__(self):\n"
        "        self.items = []\n"
        "\n"
        "    def push(self, item):\n"
        "        self.items.append(item)\n"
        "\n"
        "    def pop(self):\n"
        "        return self.items.pop()\n"
        "\n"
        "    def peek(self):\n"
        "        return self.items[-1]\n",
        "Rename the class to `LifoStack`.",
    ),
    (
        "def count_words(text):\n"
        "    counts = {}\n"
        "    for word in text.lower().split():\n"
        "        word = word.strip('.,!?')\n"
        "        counts[word] = counts.get(word, 0) + 1\n"
        "    return sorted(counts.items(), key=lambda item: -item[1])\n",
        "Make the function return only the ten most common words.",
    ),
]


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        code, edit = SNIPPETS[i % len(SNIPPETS)]
        messages = [
            {
                "role": "user",
                "content": f"{edit} Reply with the complete code only.\n\n```python\n{code}```",
            }
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        prompts.append(list(ids))
    return prompts


class Engine:
    """One in-process engine core; ``run`` times one pass of the workload through it."""

    def __init__(self, model: str, max_num_seqs: int, **spec: Any) -> None:
        self.core = EngineCore(make_config(model=model, max_num_seqs=max_num_seqs, **spec))
        self.step = self.core.step_fn()
        self.passes = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.passes += 1
        ids = [f"{self.passes}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        counts = [0, 0, 0]
        steps = 0
        start = time.perf_counter()
        for rid, prompt in zip(ids, prompts, strict=True):
            self.core.add_request(EngineCoreRequest(rid, prompt, params, 0.0))
        while self.core.has_work():
            outputs, _ = self.step()
            steps += 1
            for client in outputs.values():
                stats = client.scheduler_stats
                if stats is not None:
                    counts[0] += stats.spec_num_drafts
                    counts[1] += stats.spec_num_draft_tokens
                    counts[2] += stats.spec_num_accepted_tokens
                for out in client.all_outputs():
                    tokens[out.request_id].extend(out.new_token_ids)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "steps": steps,
            "tokens": [tokens[rid] for rid in ids],
            "drafts": counts[0],
            "draft_tokens": counts[1],
            "accepted": counts[2],
        }

    def close(self) -> None:
        self.core.shutdown()


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_model = pathlib.Path.home() / ".cache" / "enginecore" / "demo-model"
    parser.add_argument("model", nargs="?", default=str(default_model))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per config")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    spec = dict(speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens)
    print(machine_line())
    print(f"model {args.model}, greedy, {args.max_tokens} output tokens per request, {spec}")
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(tokenizer, batch)
        engines = {
            "base": Engine(args.model, batch),
            "spec": Engine(args.model, batch, **spec),
        }
        runs: dict[str, list[dict]] = {"base": [], "spec": []}
        try:
            for engine in engines.values():
                engine.run(prompts[:1], 8)  # warm-up, not timed
            for _ in range(args.repeats):  # alternate, so load changes hit both alike
                for name, engine in engines.items():
                    runs[name].append(engine.run(prompts, args.max_tokens))
        finally:
            for engine in engines.values():
                engine.close()
        base, fast = runs["base"], runs["spec"]
        num_tokens = sum(len(t) for t in base[0]["tokens"])
        base_tps = num_tokens / median([r["seconds"] for r in base])
        spec_tps = num_tokens / median([r["seconds"] for r in fast])
        drafts = sum(r["drafts"] for r in fast)
        draft_tokens = sum(r["draft_tokens"] for r in fast)
        accepted = sum(r["accepted"] for r in fast)
        row = {
            "batch": batch,
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": num_tokens,
            "base_steps": base[0]["steps"],
            "spec_steps": fast[0]["steps"],
            "base_tokens_per_s": round(base_tps, 1),
            "spec_tokens_per_s": round(spec_tps, 1),
            "speedup": round(spec_tps / base_tps, 2),
            "per_run_speedups": [
                round(b["seconds"] / f["seconds"], 2) for b, f in zip(base, fast, strict=True)
            ],
            "acceptance_rate": round(accepted / max(draft_tokens, 1), 3),
            "mean_accepted_length": round(1 + accepted / max(drafts, 1), 2),
            "identical_outputs": all(r["tokens"] == base[0]["tokens"] for r in base + fast),
        }
        rows.append(row)
        print(json.dumps(row))
        if batch == args.batch_sizes[0]:
            print("sample output:", repr(tokenizer.decode(fast[0]["tokens"][0])[:300]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["identical_outputs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
