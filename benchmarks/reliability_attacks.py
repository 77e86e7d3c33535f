"""The attack rows of ``benchmarks/reliability.py``: the KV connector, mass disconnects
of queued requests of every kind, one client flooding the queue, slow-header floods and
the Responses store after maximal requests. Each takes a running server (``Server``) and
returns one row's figures; all traffic goes to loopback addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
from typing import Any

import httpx
import zmq

from enginecore.engine.wire_auth import keys_from_secret, secure_client

KV_SECRET = "reliability-run secret"
LONG = {"max_tokens": 400, "ignore_eos": True, "stream": True}


async def _latency(url: str, source: str | None = None, rounds: int = 10) -> list[float]:
    """Seconds for a short completion, ``rounds`` times in a row (from ``source``)."""
    transport = httpx.AsyncHTTPTransport(local_address=source) if source else None
    body = {"prompt": "latency", "max_tokens": 4}
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=300, transport=transport) as client:
        for _ in range(rounds):
            started = time.perf_counter()
            answer = await client.post("/v1/completions", json=body)
            if answer.status_code == 200:
                times.append(time.perf_counter() - started)
    return times


def _p(times: list[float], q: float) -> float | None:
    if not times:
        return None
    ordered = sorted(times)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 3)


# --- the KV connector -------------------------------------------------------------------


def kv_connector(server: Any, kv_port: int, junk: int) -> dict:
    """Junk frames on the block server (a peer holding the secret), hostile
    ``kv_transfer_params``, and a handle naming an address of the client's choosing."""
    url = server.url
    idle = statistics.median(asyncio.run(_latency(url)))
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    secure_client(dealer, keys_from_secret(KV_SECRET, "zmq_p2p").for_client())
    dealer.connect(f"tcp://127.0.0.1:{kv_port}")
    answered = 0
    try:
        for i in range(junk):
            dealer.send_multipart([b"junk"] if i % 2 else [b"", b"\xc1"])
        deadline = time.monotonic() + 60
        while answered < junk and time.monotonic() < deadline:
            if dealer.poll(500):
                dealer.recv_multipart()
                answered += 1
    finally:
        context.destroy(linger=0)
    during = statistics.median(asyncio.run(_latency(url)))
    handle = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": kv_port,
        "remote_request_id": "x",
        "num_tokens": 32,
    }
    hostile = [
        {**handle, "num_tokens": "abc"},
        {k: v for k, v in handle.items() if k != "remote_host"},
        {**handle, "remote_port": 2**40},
        {**handle, "remote_request_id": {"a": 1}},
        {**handle, "extra": "field"},
    ]
    codes = []
    with socket.socket() as listener:  # a port of the client's choosing
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(2.0)
        hostile.append({**handle, "remote_port": listener.getsockname()[1]})
        for params in hostile:
            body = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": params}
            codes.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code)
        try:
            listener.accept()
            spoofed = 1
        except TimeoutError:
            spoofed = 0
    prefill = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": "the KV path " * 8,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=60,
    ).json()
    decode = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": "the KV path " * 8,
            "max_tokens": 4,
            "kv_transfer_params": prefill["kv_transfer_params"],
        },
        timeout=60,
    )
    return {
        "junk_frames": junk,
        "answered": answered,
        "rejected_metric": int(server.metric("kv_connector_rejected_messages_total")),
        "hostile_params": len(hostile),
        "4xx": sum(400 <= c < 500 for c in codes),
        "5xx": sum(c >= 500 for c in codes),
        "peer_connections": spoofed,
        "handoff_after": decode.status_code == 200,
        "latency_x": round(during / idle, 2),
    }


# --- mass disconnects of queued requests ---------------------------------------------------


def _bodies() -> dict[str, tuple[str, dict]]:
    return {
        "completions": ("/v1/completions", {"prompt": "go", **LONG}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], **LONG}),
        "responses": ("/v1/responses", {"input": "go", "max_output_tokens": 400, "stream": True}),
        "beam": (
            "/v1/completions",
            {"prompt": "go", "max_tokens": 64, "n": 4, "use_beam_search": True, "stream": True},
        ),
    }


async def _open_and_drop(url: str, path: str, body: dict, n: int) -> None:
    async def first_line(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", path, json=body) as response:
            async for _ in response.aiter_lines():
                break  # the first line: it is running; then hang up

    async def one(client: httpx.AsyncClient) -> None:
        # A queued request (or a beam search, whose one item comes at its end) sends
        # nothing for a while: hang up after a few seconds either way.
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            await asyncio.wait_for(first_line(client), 5.0)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*[one(client) for _ in range(n)])


def mass_disconnects(server: Any, model: str, n: int) -> dict:
    """For each kind: ``n`` streams opened (most of them queued), then all closed: seconds
    until the KV cache and the queue are empty."""
    result: dict[str, Any] = {"streams_per_kind": n}
    for kind, (path, body) in _bodies().items():
        asyncio.run(_open_and_drop(server.url, path, {"model": model, **body}, n))
        started = time.monotonic()
        seconds = None
        while time.monotonic() - started < 120:
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            if (
                server.metric("kv_cache_usage_perc") == 0
                and server.metric("num_requests_running") == 0
                and server.metric("num_requests_waiting") == 0
            ):
                seconds = round(time.monotonic() - started, 2)
                break
            time.sleep(0.2)
        result[f"{kind}_empty_s"] = seconds
    return result


# --- one client flooding the queue ------------------------------------------------------------


def queue_flood(server: Any, streams: int) -> dict:
    """Client A (127.0.0.1) holds ``streams`` long streams of ``n=4``; client B (127.0.0.2)
    measures a short request's latency against the idle figure, one request after
    another (the first meets the flood's full-size steps in flight)."""
    idle = asyncio.run(_latency(server.url, "127.0.0.2"))

    async def run() -> tuple[list[float], int]:
        body = {"prompt": "flood", "n": 4, **LONG}
        refused = 0

        async def one(client: httpx.AsyncClient) -> None:
            nonlocal refused
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code == 429:
                        refused += 1
                    async for _ in response.aiter_lines():
                        pass
            except httpx.HTTPError:
                pass

        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            flood = [asyncio.ensure_future(one(client)) for _ in range(streams)]
            await asyncio.sleep(3.0)
            during = await _latency(server.url, "127.0.0.2", rounds=5)
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        return during, refused

    during, refused = asyncio.run(run())
    return {
        "streams": streams,
        "refused_429": refused,
        "other_client_first_s": round(during[0], 3) if during else None,
        "other_client_p50_s": _p(during, 0.5),
        "idle_p50_s": _p(idle, 0.5),
        "latency_x": round(_p(during, 0.5) / _p(idle, 0.5), 2) if during and idle else None,
    }


# --- slow headers -----------------------------------------------------------------------------


def slow_headers(server: Any, connections: int, port: int) -> dict:
    """``connections`` slow-header sockets from 127.0.0.1; a normal client's latency
    (p50/p99 over 20 requests, 503s counted) and ``/health`` during the flood."""
    idle = asyncio.run(_latency(server.url, rounds=20))
    flood = []
    closed_at_once = 0
    for _ in range(connections):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            flood.append(sock)
        except OSError:
            closed_at_once += 1
    try:
        statuses = []
        times = []
        for _ in range(20):
            started = time.perf_counter()
            try:
                answer = httpx.post(
                    f"{server.url}/v1/completions",
                    json={"prompt": "x", "max_tokens": 4},
                    timeout=60,
                )
                statuses.append(answer.status_code)
                times.append(time.perf_counter() - started)
            except httpx.HTTPError:
                statuses.append(0)
        try:
            health = httpx.get(f"{server.url}/health", timeout=10).status_code
        except httpx.HTTPError:
            health = 0
    finally:
        for sock in flood:
            sock.close()
    return {
        "slow_connections": connections,
        "refused_at_connect": closed_at_once,
        "ok": statuses.count(200),
        "503": statuses.count(503),
        "failed": statuses.count(0),
        "p50_s": _p(times, 0.5),
        "p99_s": _p(times, 0.99),
        "idle_p50_s": _p(idle, 0.5),
        "health_during": health,
    }


# --- the Responses store ------------------------------------------------------------------------


async def _maximal_responses(url: str, n: int, user_bytes: int) -> int:
    sem = asyncio.Semaphore(8)
    body = {"input": "store me", "max_output_tokens": 2, "store": True, "user": "u" * user_bytes}

    async def one(client: httpx.AsyncClient) -> bool:
        async with sem:
            return (await client.post("/v1/responses", json=body)).status_code == 200

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return sum(await asyncio.gather(*[one(client) for _ in range(n)]))


def store_memory(server: Any, n: int, user_bytes: int = 262_000) -> dict:
    before = server.process().memory_info().rss
    ok = asyncio.run(_maximal_responses(server.url, n, user_bytes))
    after = server.process().memory_info().rss
    return {
        "requests": n,
        "ok": ok,
        "user_bytes": user_bytes,
        "rss_growth_mib": (after - before) / 2**20,
    }
