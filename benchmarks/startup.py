"""Seconds from a fresh process to a ready engine, cold and warm, and from
``enginecore serve`` to its first chat answer.

Cold: a new ``ENGINECORE_CACHE_DIR`` (every C library built, the packed GEMM's probes
run, a GGUF's tokenizer converted). Warm: that cache again. Each warm figure is the
median of ``--rounds`` runs (their range in brackets); the models default to the demo
GGUF and the demo HF checkpoint (``enginecore demo-model``).

    python benchmarks/startup.py [--rounds 3] [--model PATH ...] [--make-serve]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent

READY = """
import sys, time
started = time.perf_counter()
from enginecore import LLM, SamplingParams
llm = LLM(model=sys.argv[1])
ready = time.perf_counter() - started
llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
print(ready, time.perf_counter() - started)
llm.shutdown()
"""


def to_ready(model: str, cache: str) -> tuple[float, float]:
    """Seconds to ``LLM(model)`` returning and to its first token, in a new process."""
    env = {**os.environ, "ENGINECORE_CACHE_DIR": cache, "ENGINECORE_STARTUP_LOG": "0"}
    done = subprocess.run(
        [sys.executable, "-c", READY, model], env=env, capture_output=True, text=True, check=True
    )
    ready, first = done.stdout.split()[-2:]
    return float(ready), float(first)


def to_first_chat(model: str, cache: str, port: int) -> float:
    """Seconds from starting ``enginecore serve`` to the first chat completion's answer."""
    command = [sys.executable, "-m", "enginecore.cli", "serve", model, "--port", str(port)]
    return _first_chat(command, cache, port, model)


def make_serve_first_chat(cache: str) -> float:
    """Seconds from ``make serve`` (the README's command; the demo model on port 8000)
    to the first chat completion's answer."""
    return _first_chat(["make", "-s", "serve"], cache, 8000, "enginecore-demo", cwd=REPOSITORY)


def _first_chat(command: list[str], cache: str, port: int, model: str, cwd=None) -> float:
    env = {**os.environ, "ENGINECORE_CACHE_DIR": cache}
    started = time.perf_counter()
    server = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # make's child too is stopped with the group
    )
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        while time.perf_counter() - started < 300:
            if server.poll() is not None:
                raise RuntimeError(f"{' '.join(command)} exited with {server.returncode}")
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    json.load(answer)
                return time.perf_counter() - started
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("the server did not answer within 300 s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def spread(seconds: list[float]) -> str:
    """The median, and the range when there are several."""
    median = f"{statistics.median(seconds):.1f} s"
    if len(seconds) < 2:
        return median
    return f"{median} ({min(seconds):.1f}-{max(seconds):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", action="append", help="default: the demo GGUF and HF model")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--make-serve", action="store_true", help="also time `make serve` (uses port 8000)"
    )
    args = parser.parse_args()
    if not args.model:
        from enginecore.checkpoints import find_demo_gguf, make_demo_checkpoint

        args.model = [str(find_demo_gguf()), str(make_demo_checkpoint())]
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| model | cold: ready / first token | warm: ready / first token | serve: first chat |")
    print("|---|---|---|---|")
    for model in args.model:
        with tempfile.TemporaryDirectory() as cache:
            cold = to_ready(model, cache)
            warm = [to_ready(model, cache) for _ in range(args.rounds)]
            chats = [to_first_chat(model, cache, args.port) for _ in range(args.rounds)]
        print(
            f"| {os.path.basename(model)} | {cold[0]:.1f} / {cold[1]:.1f} s | "
            f"{spread([w[0] for w in warm])} / {spread([w[1] for w in warm])} | "
            f"{spread(chats)} |"
        )
    if args.make_serve:
        with tempfile.TemporaryDirectory() as cache:
            first_run = make_serve_first_chat(cache)
            chats = [make_serve_first_chat(cache) for _ in range(args.rounds)]
        print(
            f"\n`make serve` to its first chat: {first_run:.1f} s the first time (the demo "
            f"checkpoint made, every C library built), then {spread(chats)}"
        )


if __name__ == "__main__":
    main()
