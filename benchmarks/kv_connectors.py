"""KV connector benchmarks.

1. ``shared_storage`` on a shared-prefix workload: engine A computes a set of documents
   (long prompts) and saves their KV; engine B (a new process on the same directory) gets
   the same documents, each followed by a new question. Baseline: engine C, no connector,
   same workload as B. Reported: wall time of the prefill-bound batch (``max_tokens=1``),
   prompt tokens the model computed (scheduler stats) and effective prompt tokens/s.
2. Disaggregated prefill/decode (``zmq_p2p``) vs one engine under mixed load: short chat
   requests decode while long-document requests arrive. P/D runs a prefill AsyncLLM
   (``kv_producer``) and a decode AsyncLLM (``kv_consumer``) in their own engine
   processes, each request going prefill (max_tokens=1) -> decode with the handoff, as
   ``enginecore disagg-proxy`` does (without the HTTP hop). Reported: TTFT and ITL per
   request class, both setups measured in the same run.

    python benchmarks/kv_connectors.py [--size tiny|small] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from enginecore import LLM, AsyncLLM, SamplingParams
from enginecore.engine.output import OutputKind
from enginecore.testing.kv_connector_contract import free_port

COMMON = dict(dtype="float32", block_size=16, max_model_len=2048, num_blocks_override=1200)


# --- 1. shared_storage ---------------------------------------------------------------


def shared_prefix_workload(seed: int, num_docs: int, doc_len: int, question_len: int):
    rng = random.Random(seed)
    docs = [[rng.randrange(10, 8000) for _ in range(doc_len)] for _ in range(num_docs)]

    def ask():
        return [d + [rng.randrange(10, 8000) for _ in range(question_len)] for d in docs]

    return ask(), ask()  # what engine A saw, what engines B and C see


def timed_prefill(llm: LLM, prompts: list[list[int]]) -> tuple[float, list]:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params)  # warm-up, not shared
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, outs


def bench_shared_storage(model: str, args) -> dict:
    first, second = shared_prefix_workload(1, args.docs, args.doc_len, args.question_len)
    total = sum(map(len, second))
    with tempfile.TemporaryDirectory() as store:
        kv = {"connector": "shared_storage", "extra_config": {"path": store}}
        with LLM(model, kv_transfer=kv, **COMMON) as a:
            timed_prefill(a, first)
        with LLM(model, kv_transfer=kv, **COMMON) as b:
            with_connector, outs_b = timed_prefill(b, second)
        with LLM(model, **COMMON) as c:
            baseline, outs_c = timed_prefill(c, second)
    loaded = sum(o.num_cached_tokens for o in outs_b)
    same = all(
        x.outputs[0].token_ids == y.outputs[0].token_ids
        for x, y in zip(outs_b, outs_c, strict=True)
    )
    return {
        "requests": len(second),
        "prompt_tokens": total,
        "loaded_tokens_shared_storage": loaded,
        "computed_tokens_shared_storage": total - loaded,
        "seconds_baseline": baseline,
        "seconds_shared_storage": with_connector,
        "prompt_tokens_per_s_baseline": total / baseline,
        "prompt_tokens_per_s_shared_storage": total / with_connector,
        "speedup": baseline / with_connector,
        "same_first_tokens": same,
    }


# --- 2. disaggregated prefill/decode -------------------------------------------------


def mixed_load(seed: int, num_chat: int, num_docs: int, doc_len: int):
    """(arrival offset s, prompt, max_tokens, class) sorted by arrival."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_chat):
        prompt = [rng.randrange(10, 8000) for _ in range(48)]
        reqs.append((0.05 * i, prompt, 48, "chat"))
    for i in range(num_docs):
        prompt = [rng.randrange(10, 8000) for _ in range(doc_len)]
        reqs.append((0.3 + 0.4 * i, prompt, 8, "doc"))
    return sorted(reqs, key=lambda r: r[0])


async def _stream(llm: AsyncLLM, prompt, params, request_id, times: list[float]) -> list:
    out = None
    async for out in llm.generate(
        {"prompt_token_ids": prompt}, params, request_id, output_kind=OutputKind.DELTA
    ):
        if out.outputs and out.outputs[0].token_ids:
            times.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    return out


async def run_mixed(workload, single: AsyncLLM | None, prefill=None, decode=None) -> list[dict]:
    start = time.perf_counter()

    async def one(i, offset, prompt, max_tokens, kind):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        sent = time.perf_counter()
        times: list[float] = []
        greedy = dict(temperature=0.0, ignore_eos=True)
        if single is not None:
            await _stream(
                single, prompt, SamplingParams(max_tokens=max_tokens, **greedy), f"s{i}", times
            )
        else:
            handoff = None
            async for out in prefill.generate(
                {"prompt_token_ids": prompt},
                SamplingParams(
                    max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **greedy
                ),
                f"p{i}",
                output_kind=OutputKind.FINAL_ONLY,
            ):
                handoff = out.kv_transfer_params
            params = SamplingParams(max_tokens=max_tokens, kv_transfer_params=handoff, **greedy)
            await _stream(decode, prompt, params, f"d{i}", times)
        itl = [b - a for a, b in itertools.pairwise(times)]
        return {"kind": kind, "ttft": times[0] - sent, "itl": itl}

    return await asyncio.gather(*(one(i, *r) for i, r in enumerate(workload)))


def summarize(results: list[dict]) -> dict:
    summary = {}
    for kind in ("chat", "doc"):
        rows = [r for r in results if r["kind"] == kind]
        ttft = sorted(r["ttft"] for r in rows)
        itl = sorted(x for r in rows for x in r["itl"])
        summary[kind] = {
            "ttft_mean_ms": 1000 * statistics.mean(ttft),
            "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
            "itl_mean_ms": 1000 * statistics.mean(itl) if itl else 0.0,
            "itl_p99_ms": 1000 * itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else 0.0,
        }
    return summary


async def bench_disagg(model: str, args) -> dict:
    workload = mixed_load(2, args.chat, args.long_docs, args.doc_len)
    single = AsyncLLM(model, **COMMON)
    try:
        await run_mixed(workload[:2], single)  # warm-up
        single_results = await run_mixed(workload, single)
    finally:
        single.shutdown()
    port = free_port()
    prefill = AsyncLLM(
        model,
        kv_transfer={"connector": "zmq_p2p", "role": "kv_producer", "extra_config": {"port": port}},
        **COMMON,
    )
    consumer = {"peers": [f"127.0.0.1:{port}"]}
    decode = AsyncLLM(
        model,
        kv_transfer={"connector": "zmq_p2p", "role": "kv_consumer", "extra_config": consumer},
        **COMMON,
    )
    try:
        await run_mixed(workload[:2], None, prefill, decode)  # warm-up
        pd_results = await run_mixed(workload, None, prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()
    return {"single": summarize(single_results), "disagg": summarize(pd_results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint (default: a random Llama of --size)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--chat", type=int, default=8)
    parser.add_argument("--long-docs", type=int, default=6)
    parser.add_argument("--skip", choices=["shared_storage", "disagg"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from enginecore.checkpoints import make_random_checkpoint

            model = str(make_random_checkpoint(Path(tmp) / "m", arch="llama", size=args.size))
        results: dict = {"size": args.size}
        if args.skip != "shared_storage":
            results["shared_storage"] = bench_shared_storage(model, args)
            print(json.dumps(results["shared_storage"], indent=2))
        if args.skip != "disagg":
            results["disagg"] = asyncio.run(bench_disagg(model, args))
            print(json.dumps(results["disagg"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
