"""Reliability run against local ``enginecore serve`` processes (tiny random model unless
``--model``), bounded in time, printing one table. Not part of ``make test``.

    python benchmarks/reliability.py [--streams 500] [--disconnects 200] [--requests 2000]
    python benchmarks/reliability.py --checks attacks   # only the attack rows
    python benchmarks/reliability.py --checks faults    # only the fault rows

Rows: concurrent streams held with no error; client disconnects with the KV cache back to
0; the bad-input corpus (4xx / 5xx / dropped connections); server memory growth over
``--requests`` requests; SIGTERM drain (streams ended with ``[DONE]``, exit status,
processes and temporary files left); SIGKILL of the engine and of an ``mp`` worker (time
until every stream got its error, the server's exit status, processes left). The attack
rows (:mod:`reliability_attacks`): the KV connector (junk frames on the block server,
hostile ``kv_transfer_params``, a handle naming the client's own address), mass
disconnects of queued completions, chat, responses and beam-search streams (seconds
until the KV cache and the queue are empty), one client flooding the queue (another
client's latency, FCFS and ``fair_share``), a slow-header flood (a normal request's
p50/p99 and ``/health`` during it) and the server's memory after ``--store-requests``
maximal Responses requests. The fault rows (:mod:`reliability_faults`): one address
holding ``--address-sockets`` connections past its cap (what it gets, another address's
latency), ``--kv-requests`` long requests at once into a 16-block KV cache (answered in
full, preemptions, the cache empty after), SIGKILL of the engine mid-prefill and of the
frontend mid-stream (the error named, exit status, processes and temporary files left).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import reliability_attacks as attacks
import reliability_faults as faults

STREAM = {"prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
BAD_BODIES = [
    '{"prompt": "hi", "max_tokens": 18446744073709551616}',
    '{"prompt": "hi", "top_k": 99999999999999999999999}',
    '{"prompt": "\\ud800"}',
    '{"prompt": "hi", "stop": ["\\udfff"]}',
    '{"prompt": "hi", "temperature": NaN}',
    '{"prompt": "hi", "repetition_penalty": Infinity}',
    '{"prompt": "hi", "metadata": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}",
    '{"prompt": "hi", "kv_transfer_params": ' + "[" * 500 + "]" * 500 + "}",
    '{"prompt": ["a"], "n": 100000}',
    '{"prompt": ' + json.dumps(["x"] * 50_000) + "}",
    '{"prompt": "hi", "logit_bias": {"99999999": 5}}',
    '{"prompt": "hi", "max_tokens": -1}',
    '{"prompt": [], "max_tokens": 2}',
    '{"prompt": "hi", "guided_json": "{"}',
    "not json at all",
    '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``enginecore serve`` with its own temporary directory."""

    def __init__(self, model: str, workdir: Path, *flags: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(dir=workdir))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.tmp.parent / f"server-{port}.log", "w")  # noqa: SIM115
        env = dict(os.environ, TMPDIR=str(self.tmp))
        args = ["serve", model, "--port", str(port), "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "enginecore.cli", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        self.tree = [psutil.Process(self.proc.pid), *self.process().children(recursive=True)]

    def process(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    def engine(self) -> psutil.Process:
        def is_engine(p: psutil.Process) -> bool:  # its start-up command, or its title
            command = " ".join(p.cmdline())
            return "core_proc" in command or command.startswith("EngineCore_DP")

        return next(p for p in self.process().children() if is_engine(p))

    def left_behind(self) -> int:
        return sum(1 for p in self.tree if p.is_running() and p.status() != "zombie")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"enginecore:{name}")
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in self.tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.log.close()


async def _stream(client: httpx.AsyncClient, stop_after: int | None = None) -> str:
    """'done', 'error' (an error event before [DONE]), 'cut' (no [DONE]) or 'closed'."""
    saw_error = False
    try:
        async with client.stream("POST", "/v1/completions", json=STREAM) as response:
            if response.status_code != 200:
                return "error"
            chunks = 0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return "error" if saw_error else "done"
                if line.startswith('data: {"error"'):
                    saw_error = True
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return "closed"
    except httpx.HTTPError:
        pass
    return "cut"


async def concurrent_streams(server: Server, n: int) -> dict:
    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        outcomes = await asyncio.gather(*[_stream(client) for _ in range(n)])
    return {"streams": n, "errors": sum(o != "done" for o in outcomes)}


async def disconnects(server: Server, n: int) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        await asyncio.gather(*[_stream(client, stop_after=2) for _ in range(n)])
    started = time.monotonic()
    while time.monotonic() - started < 60:
        await asyncio.sleep(0.2)
        # The gauges move with engine steps: one tiny request makes one more step.
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        if server.metric("kv_cache_usage_perc") == 0 and server.metric("num_requests_running") == 0:
            return {"disconnects": n, "kv_back_to_0_s": round(time.monotonic() - started, 2)}
    return {"disconnects": n, "kv_back_to_0_s": None}


def bad_inputs(server: Server) -> dict:
    counts = {"4xx": 0, "5xx": 0, "dropped": 0}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for body in BAD_BODIES:
            try:
                response = client.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
            except httpx.HTTPError:
                counts["dropped"] += 1
                continue
            counts["5xx" if response.status_code >= 500 else "4xx"] += 1
            if response.headers.get("connection") == "close":
                counts["dropped"] += 1
    counts["healthy_after"] = httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    return {"bad_inputs": len(BAD_BODIES), **counts}


async def memory_growth(server: Server, n: int) -> dict:
    body = {"prompt": "memory", "max_tokens": 4}
    sem = asyncio.Semaphore(32)

    async def one(client: httpx.AsyncClient) -> bool:
        async with sem:
            return (await client.post("/v1/completions", json=body)).status_code == 200

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        await asyncio.gather(*[one(client) for _ in range(200)])  # warm-up
        before = server.process().memory_info().rss
        ok = await asyncio.gather(*[one(client) for _ in range(n)])
        after = server.process().memory_info().rss
    return {"requests": n, "failed": n - sum(ok), "rss_growth_mib": (after - before) / 2**20}


async def _kill_during_streams(server: Server, victim: psutil.Process, n: int) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        tasks = [asyncio.ensure_future(_stream(client)) for _ in range(n)]
        await asyncio.sleep(1.0)
        killed = time.monotonic()
        victim.kill()
        outcomes = await asyncio.gather(*tasks)
        to_error = time.monotonic() - killed
    try:
        status = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        status = None
    return {
        "streams": n,
        "errored": sum(o == "error" for o in outcomes),
        "time_to_error_s": round(to_error, 2),
        "exit_status": status,
        "processes_left": server.left_behind(),
        "temp_files_left": await _temp_files_left(server),
    }


async def _temp_files_left(server: Server) -> int:
    """Entries left in the server's temp dir once its processes are gone (a killed
    worker's engine, or a killed engine's workers, exit within a second)."""
    for _ in range(50):
        if not server.left_behind() and not any(server.tmp.iterdir()):
            break
        await asyncio.sleep(0.1)
    return len(list(server.tmp.iterdir()))


async def sigterm_drain(server: Server, n: int) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        tasks = [asyncio.ensure_future(_stream(client)) for _ in range(n)]
        await asyncio.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
    status = await asyncio.to_thread(server.proc.wait, 60)
    await asyncio.sleep(1.0)
    return {
        "streams": n,
        "ended_with_done": sum(o in ("done", "error") for o in outcomes),
        "exit_status": status,
        "processes_left": server.left_behind(),
        "temp_files_left": await _temp_files_left(server),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: a tiny random Llama)")
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--disconnects", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--checks", default="base,attacks,faults", help="base, attacks, faults (any of them)"
    )
    parser.add_argument("--junk", type=int, default=1000, help="junk frames to the KV server")
    parser.add_argument("--queued", type=int, default=50, help="streams per kind, dropped")
    parser.add_argument("--flood-streams", type=int, default=400)
    parser.add_argument("--slow-connections", type=int, default=3000)
    parser.add_argument("--store-requests", type=int, default=2000)
    parser.add_argument("--address-sockets", type=int, default=200)
    parser.add_argument("--kv-requests", type=int, default=12)
    args = parser.parse_args()
    checks = set(args.checks.split(","))
    rows: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory() as work:
        workdir = Path(work)
        model = args.model
        if model is None:
            from enginecore.checkpoints import make_random_checkpoint

            model = str(make_random_checkpoint(workdir / "model"))
        if "attacks" in checks:
            rows += attack_rows(model, workdir, args)
        if "faults" in checks:
            rows += fault_rows(model, workdir, args)
        if "base" in checks:
            rows += base_rows(model, workdir, args)
    print("| check | result |")
    print("|---|---|")
    for name, result in rows:
        text = ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
        )
        print(f"| {name} | {text} |")


def attack_rows(model: str, workdir: Path, args: argparse.Namespace) -> list[tuple[str, dict]]:
    rows: list[tuple[str, dict]] = []
    kv_port = _free_port()
    extra = json.dumps({"port": kv_port, "secret": attacks.KV_SECRET})
    kv_flags = ("--kv-connector", "zmq_p2p", "--kv-role", "kv_both")
    server = Server(model, workdir, *kv_flags, "--kv-connector-extra-config", extra)
    try:
        rows.append(("KV connector", attacks.kv_connector(server, kv_port, args.junk)))
    finally:
        server.close()
    server = Server(model, workdir, "--stat-loggers", "")
    try:
        model_name = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        rows.append(
            ("queued disconnects", attacks.mass_disconnects(server, model_name, args.queued))
        )
        rows.append(("queue flood (fcfs)", attacks.queue_flood(server, args.flood_streams)))
        port = int(server.url.rsplit(":", 1)[1])
        rows.append(("slow headers", attacks.slow_headers(server, args.slow_connections, port)))
        rows.append(("responses store", attacks.store_memory(server, args.store_requests)))
    finally:
        server.close()
    server = Server(model, workdir, "--scheduling-policy", "fair_share", "--stat-loggers", "")
    try:
        rows.append(("queue flood (fair_share)", attacks.queue_flood(server, args.flood_streams)))
    finally:
        server.close()
    server = Server(model, workdir, "--max-num-seqs-per-client", "0", "--stat-loggers", "")
    try:
        flood = attacks.queue_flood(server, args.flood_streams)
        rows.append(("queue flood (fcfs, no per-client cap)", flood))
    finally:
        server.close()
    return rows


def fault_rows(model: str, workdir: Path, args: argparse.Namespace) -> list[tuple[str, dict]]:
    rows: list[tuple[str, dict]] = []
    server = Server(model, workdir, "--max-open-connections-per-client", "100")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        rows.append(
            (
                "connections per address (cap 100)",
                faults.connections_per_address(server, port, args.address_sockets),
            )
        )
    finally:
        server.close()
    small_kv = ("--num-blocks-override", "16", "--max-model-len", "256", "--no-prefix-caching")
    server = Server(model, workdir, *small_kv)
    try:
        rows.append(("KV exhaustion (16 blocks)", faults.kv_exhaustion(server, args.kv_requests)))
    finally:
        server.close()
    server = Server(model, workdir, "--max-model-len", "4096", "--max-num-batched-tokens", "16")
    try:
        rows.append(("SIGKILL engine mid-prefill", faults.kill_engine_mid_prefill(server)))
    finally:
        server.close()
    server = Server(model, workdir, "--stat-loggers", "")
    try:
        rows.append(("SIGKILL frontend mid-stream", faults.kill_frontend_mid_stream(server)))
    finally:
        server.close()
    return rows


def base_rows(model: str, workdir: Path, args: argparse.Namespace) -> list[tuple[str, dict]]:
    rows: list[tuple[str, dict]] = []
    flags = ("--shutdown-timeout", "20", "--stat-loggers", "")
    server = Server(model, workdir, *flags)
    try:
        rows.append(("concurrent streams", asyncio.run(concurrent_streams(server, args.streams))))
        rows.append(("client disconnects", asyncio.run(disconnects(server, args.disconnects))))
        rows.append(("bad-input corpus", bad_inputs(server)))
        rows.append(("memory", asyncio.run(memory_growth(server, args.requests))))
        rows.append(("SIGTERM drain", asyncio.run(sigterm_drain(server, 20))))
    finally:
        server.close()
    server = Server(model, workdir, "--stat-loggers", "")
    try:
        rows.append(
            ("SIGKILL engine", asyncio.run(_kill_during_streams(server, server.engine(), 20)))
        )
    finally:
        server.close()
    server = Server(model, workdir, "--executor", "mp", "--stat-loggers", "")
    try:
        worker = server.engine().children()[0]
        rows.append(("SIGKILL worker", asyncio.run(_kill_during_streams(server, worker, 20))))
    finally:
        server.close()
    return rows


if __name__ == "__main__":
    main()
