"""``enginecore bench serve``: an HTTP load generator for an OpenAI-compatible server.

Random dataset (prompts of random token ids, fixed input and output lengths, EOS
ignored), streamed ``/v1/completions`` requests sent at a Poisson request rate or all at
once, optionally capped by a maximum concurrency. Reports request throughput, output
tokens/s and TTFT / TPOT / ITL (mean, p50, p99), writes a JSON result file, and for a
sweep over several request rates a PNG plot (when matplotlib is installed).

Definitions (those of vLLM's benchmark, so figures compare): TTFT is request sent to the
first streamed token; TPOT is (latency - TTFT) / (output tokens - 1); ITL is the gap
between consecutive streamed chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts; ids avoid the lowest 256 (special and byte tokens)."""
    rng = random.Random(seed)
    low = min(256, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num)]


async def one_request(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    try:
        async with http.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if not data.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": sum(ordered) / len(ordered), "p50": pct(50), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float, request_rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ms = 1000.0
    summary: dict[str, Any] = {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        for stat, value in _percentiles(values).items():
            summary[f"{stat}_{name}_ms"] = value * ms
    return summary


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="requests", unit="req")
            except ImportError:
                self.total, self.done = total, 0

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
        elif hasattr(self, "done"):
            self.done += 1
            sys.stderr.write(f"\r{self.done}/{self.total} requests")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif hasattr(self, "done"):
            sys.stderr.write("\n")


async def run_load(
    base_url: str,
    prompts: list[list[int]],
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    *,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals at ``request_rate``; inf: all at once)."""
    # aiohttp, not httpx: streaming 200 requests at once, httpx's per-chunk overhead took
    # about half a core on this 2-core machine, CPU the servers under test then lacked.
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # no cap: max_concurrency is the cap
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as http:
        if model is None:
            async with http.get(f"{base_url}/v1/models") as response:
                models = await response.json()
            model = models["data"][0]["id"]
        url = f"{base_url}/v1/completions"
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = _Progress(len(prompts), progress)
        rng = random.Random(seed)

        async def send(prompt: list[int]) -> RequestResult:
            if semaphore is None:
                result = await one_request(http, url, model, prompt, output_len)
            else:
                async with semaphore:
                    result = await one_request(http, url, model, prompt, output_len)
            bar.update()
            return result

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(prompt)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def plot_sweep(summaries: list[dict[str, Any]], path: str) -> bool:
    """TTFT / TPOT p50 and output throughput against request rate; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    finite = [s for s in summaries if s["request_rate"] != "inf"]
    if not finite:
        return False
    rates = [s["request_rate"] for s in finite]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(rates, [s["p50_ttft_ms"] for s in finite], "o-", label="p50")
    axes[0].plot(rates, [s["p99_ttft_ms"] for s in finite], "s--", label="p99")
    axes[0].set(title="TTFT", xlabel="request rate (req/s)", ylabel="ms")
    axes[1].plot(rates, [s["p50_tpot_ms"] for s in finite], "o-", label="p50")
    axes[1].plot(rates, [s["p99_tpot_ms"] for s in finite], "s--", label="p99")
    axes[1].set(title="TPOT", xlabel="request rate (req/s)", ylabel="ms")
    axes[2].plot(rates, [s["output_throughput"] for s in finite], "o-")
    axes[2].set(title="output throughput", xlabel="request rate (req/s)", ylabel="tokens/s")
    for ax in axes[:2]:
        ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"request rate:        {s['request_rate']}",
        f"completed / failed:  {s['completed']} / {s['failed']}",
        f"duration:            {s['duration_s']:.2f} s",
        f"request throughput:  {s['request_throughput']:.2f} req/s",
        f"output throughput:   {s['output_throughput']:.1f} tok/s",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(
            f"{name.upper():<5} ms  mean {s[f'mean_{name}_ms']:9.2f}   "
            f"p50 {s[f'p50_{name}_ms']:9.2f}   p99 {s[f'p99_{name}_ms']:9.2f}"
        )
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8192, help="random token id range")
    parser.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s (Poisson); 'inf' sends all at once; a comma list sweeps",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--seed", type=int, default=0, help="prompt seed; the i-th rate of a sweep uses seed + i"
    )
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="PNG of a request-rate sweep")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    rates = [float(r) for r in str(args.request_rate).split(",") if r]
    summaries = []
    for index, rate in enumerate(rates):
        # Fresh prompts for every rate of a sweep: repeating them would let a server with
        # prefix caching answer later rates from its cache.
        seed = args.seed + index
        prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, seed)
        results, duration = asyncio.run(
            run_load(
                args.base_url.rstrip("/"),
                prompts,
                args.output_len,
                rate,
                args.max_concurrency,
                model=args.model,
                api_key=args.api_key,
                seed=seed,
                progress=not args.no_progress,
            )
        )
        summary = summarize(results, duration, rate)
        summary.update(
            seed=seed,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
        )
        summaries.append(summary)
        print(format_summary(summary), flush=True)
        print(flush=True)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summaries if len(summaries) > 1 else summaries[0], f, indent=2)
    if args.plot:
        if plot_sweep(summaries, args.plot):
            print(f"plot written to {args.plot}")
        else:
            print("no plot: needs matplotlib and at least one finite request rate")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
