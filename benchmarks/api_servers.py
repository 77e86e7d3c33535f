"""A tokenization-heavy serving load (long text prompts, short outputs) against
``enginecore serve`` with 1 and 2 API servers, started alternately in the same run.

    python benchmarks/api_servers.py --rounds 2 --num-requests 200 --concurrency 32

Each round starts the server once per API-server count on the same random-weight
checkpoint, sends the same text prompts (tokenized by the server: that is the work
several API servers share), streams each reply to time its first token, and stops the
server. Prints requests/s and TTFT p50/p99 per count and round, then the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from random_words import WORDS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(words))
        for _ in range(num)
    ]


def _start(
    model: str, count: int, log: pathlib.Path, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "enginecore.cli", "serve", model, "--port", str(port)]
    cmd += ["--api-server-count", str(count), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(2)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _load(
    url: str, prompts: list[str], concurrency: int, max_tokens: int
) -> dict[str, float]:
    ttfts: list[float] = []
    errors = 0
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient, prompt: str) -> None:
        nonlocal errors
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        async with gate:
            start = time.perf_counter()
            first = None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - start
                if response.status_code != 200 or first is None:
                    errors += 1
                    return
            ttfts.append(first)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        elapsed = time.perf_counter() - start
    ttfts.sort()
    return {
        "requests_per_s": len(ttfts) / elapsed,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        "errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a random-weight tiny Llama")
    parser.add_argument("--counts", default="1,2", help="API server counts, alternated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-api-servers-"))
    model = args.model
    if model is None:
        from enginecore.checkpoints import make_random_checkpoint

        model = str(make_random_checkpoint(work / "model"))
    extra = ["--max-model-len", "4096", "--max-num-seqs", str(args.concurrency)]
    extra += ["--no-prefix-caching", "--executor", "uni"]
    prompts = _prompts(args.num_requests, args.prompt_words, seed=0)
    warmup = _prompts(8, args.prompt_words, seed=1)
    counts = [int(c) for c in args.counts.split(",")]
    results: dict[int, list[dict[str, float]]] = {c: [] for c in counts}
    for round_no in range(args.rounds):
        for count in counts:
            proc, url = _start(model, count, work / f"serve-{count}-{round_no}.log", extra)
            try:
                asyncio.run(_load(url, warmup, args.concurrency, args.max_tokens))
                summary = asyncio.run(_load(url, prompts, args.concurrency, args.max_tokens))
            finally:
                _stop(proc)
            results[count].append(summary)
            print(f"round {round_no} api servers {count}: {json.dumps(summary)}", flush=True)
    print(f"load average {os.getloadavg()}")
    for count, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"median, {count} API server(s): {json.dumps(med)}")
    if args.result_file:
        pathlib.Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
