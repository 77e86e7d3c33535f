"""Load test: N concurrent streaming requests (default 500) must all succeed and leave no
KV block behind. Not part of ``make test`` (it takes minutes on a CPU).

    python benchmarks/load_test.py                      # starts a server on a random tiny model
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000   # an existing server

Checks, after every request has finished: zero failed requests, every request produced
exactly ``--output-len`` tokens, and one more request later the server reports
``enginecore:kv_cache_usage_perc == 0`` and no running or waiting request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from enginecore.bench.serving import random_prompts, run_load, summarize


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model: str | None, extra: list[str]):
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from enginecore.checkpoints import make_random_checkpoint

            model = str(
                make_random_checkpoint(os.path.join(tmp, "tiny"), arch="llama", size="tiny")
            )
        port = _free_port()
        cmd = [sys.executable, "-m", "enginecore.cli", "serve", model, "--port", str(port), *extra]
        proc = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with code {proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not become healthy")
                time.sleep(0.5)
            yield url
        finally:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def gauges(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="an existing server (else one starts)")
    parser.add_argument("--model", default=None, help="checkpoint for the started server")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    args = parser.parse_args()

    server = (
        contextlib.nullcontext(args.base_url)
        if args.base_url
        else local_server(args.model, args.server_arg)
    )
    with server as url:
        prompts = random_prompts(args.num_requests, args.input_len, 8192, seed=1)
        results, duration = asyncio.run(
            run_load(url, prompts, args.output_len, float("inf"), None, api_key=args.api_key)
        )
        summary = summarize(results, duration, float("inf"))
        short = [r for r in results if r.ok and r.output_tokens != args.output_len]
        # One more request: its last step's stats show the pool after everything finished.
        asyncio.run(run_load(url, prompts[:1], 2, float("inf"), None, api_key=args.api_key))
        metrics = gauges(url)
    usage = metrics.get("enginecore:kv_cache_usage_perc", -1.0)
    running = metrics.get("enginecore:num_requests_running", -1.0)
    waiting = metrics.get("enginecore:num_requests_waiting", -1.0)
    print(
        f"{summary['completed']} completed, {summary['failed']} failed in {duration:.1f} s "
        f"({summary['output_throughput']:.0f} output tok/s); errors: {summary['errors']}"
    )
    print(f"after: kv_cache_usage={usage} running={running} waiting={waiting}")
    problems = []
    if summary["failed"]:
        problems.append(f"{summary['failed']} requests failed")
    if short:
        problems.append(f"{len(short)} requests returned fewer than {args.output_len} tokens")
    if usage != 0.0 or running != 0.0 or waiting != 0.0:
        problems.append("KV blocks or requests were left behind")
    print("FAIL: " + "; ".join(problems) if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
