"""The fault rows of ``benchmarks/reliability.py`` (``--checks faults``): one address
holding many connections, KV-cache exhaustion with a preemption storm, and SIGKILL at odd
moments (the engine mid-prefill, the frontend mid-stream). Each takes running servers
(``Server``) and returns one row's figures; all traffic goes to loopback addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from typing import Any

import httpx
from reliability_attacks import _latency, _p


def connections_per_address(server: Any, port: int, sockets: int) -> dict:
    """``sockets`` slow-header connections from 127.0.0.1 (past its per-address cap):
    what that address gets, and another address's latency and ``/health`` meanwhile."""
    idle = asyncio.run(_latency(server.url, "127.0.0.2"))
    held: list[socket.socket] = []
    closed_at_connect = 0
    try:
        for _ in range(sockets):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            held.append(sock)
            with contextlib.suppress(OSError):  # closed at once: counted below
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(0.5)
        for sock in held:
            sock.setblocking(False)
            try:
                closed_at_connect += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed_at_connect += 1
        try:  # past the reserve the address's new connection is closed at once
            own: int | str = httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ).status_code
        except httpx.HTTPError:
            own = "closed"
        during = asyncio.run(_latency(server.url, "127.0.0.2"))
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        health = other.get(f"{server.url}/health", timeout=10).status_code
        other.close()
    finally:
        for sock in held:
            sock.close()
    return {
        "sockets": sockets,
        "closed_at_connect": closed_at_connect,
        "same_address": own,
        "other_p50_s": _p(during, 0.5),
        "idle_p50_s": _p(idle, 0.5),
        "other_ok": len(during),
        "health_other": health,
    }


def kv_exhaustion(server: Any, requests: int) -> dict:
    """``requests`` long requests at once into a 16-block KV cache (each fits alone):
    answered in full, preemptions, seconds until the cache is empty, a request after."""
    body = {"max_tokens": 64, "ignore_eos": True, "temperature": 0.0}
    before = server.metric("num_preemptions_total")

    async def storm() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            answers = await asyncio.gather(
                *[
                    client.post(
                        "/v1/completions",
                        json={"prompt": [5 + (7 * i + j) % 300 for j in range(64)], **body},
                    )
                    for i in range(requests)
                ],
                return_exceptions=True,
            )
        return [
            a.json()["usage"]["completion_tokens"]
            if isinstance(a, httpx.Response) and a.status_code == 200
            else -1
            for a in answers
        ]

    started = time.monotonic()
    tokens = asyncio.run(storm())
    elapsed = time.monotonic() - started
    empty_s = None
    for _ in range(100):
        if server.metric("kv_cache_usage_perc") == 0 and server.metric("num_requests_running") == 0:
            empty_s = round(time.monotonic() - started - elapsed, 2)
            break
        time.sleep(0.1)
    after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    return {
        "requests": requests,
        "complete": sum(t == 64 for t in tokens),
        "failed": sum(t < 0 for t in tokens),
        "preemptions": int(server.metric("num_preemptions_total") - before),
        "storm_s": round(elapsed, 1),
        "kv_empty_after_s": empty_s,
        "served_after": after.status_code,
    }


async def _one_stream(url: str, body: dict, events: list[str]) -> None:
    try:
        async with (
            httpx.AsyncClient(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError:
        events.append("<cut>")


def kill_engine_mid_prefill(server: Any) -> dict:
    """SIGKILL of the engine while a 3,000-token prompt is prefilled in 16-token chunks
    (start the server with ``--max-num-batched-tokens 16``)."""

    async def run() -> tuple[list[str], float, bool]:
        events: list[str] = []
        body = {"prompt": [5 + i % 300 for i in range(3000)], "max_tokens": 8}
        task = asyncio.ensure_future(_one_stream(server.url, body, events))
        for _ in range(300):
            if server.metric("num_requests_running") >= 1:
                break
            await asyncio.sleep(0.05)
        mid_prefill = not events
        killed = time.monotonic()
        server.engine().kill()
        await task
        return events, time.monotonic() - killed, mid_prefill

    events, to_error, mid_prefill = asyncio.run(run())
    status = server.proc.wait(60)
    return {
        "killed_mid_prefill": mid_prefill,
        "error_named": any("died" in e for e in events),
        "time_to_error_s": round(to_error, 2),
        "exit_status": status,
        "processes_left": server.left_behind(),
        "temp_files_left": _temp_left(server),
    }


def kill_frontend_mid_stream(server: Any) -> dict:
    """SIGKILL of the frontend while it streams: seconds until its engine is gone."""

    async def run() -> list[str]:
        events: list[str] = []
        body = {"prompt": "go", "max_tokens": 400, "ignore_eos": True}
        task = asyncio.ensure_future(_one_stream(server.url, body, events))
        while len(events) < 3 and not task.done():
            await asyncio.sleep(0.05)
        server.proc.send_signal(signal.SIGKILL)
        await task
        return events

    events = asyncio.run(run())
    killed = time.monotonic()
    server.proc.wait(10)
    gone_s = None
    for _ in range(300):
        if not server.left_behind():
            gone_s = round(time.monotonic() - killed, 2)
            break
        time.sleep(0.1)
    return {
        "stream_cut": events[-1:] == ["<cut>"],
        "engine_gone_s": gone_s,
        "processes_left": server.left_behind(),
        "temp_files_left": _temp_left(server),
    }


def _temp_left(server: Any) -> int:
    for _ in range(50):
        if not any(server.tmp.iterdir()):
            break
        time.sleep(0.1)
    return len(list(server.tmp.iterdir()))
