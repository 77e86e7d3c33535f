"""The served side of the data-parallel sockets' guard, on a real Ray deployment: peers
the frontend's CURVE sockets refuse show in ``/metrics``
(``enginecore:data_parallel_refused_connections_total``) while every replica keeps
serving, and once the key-checking (ZAP) thread is dead ``/health`` answers 503 naming
it (before, it stayed 200 while the sockets were unguarded)."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
import zmq
from fastapi.testclient import TestClient

from enginecore import make_config
from enginecore.engine.wire_auth import authenticator_for

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

COUNTER = "enginecore:data_parallel_refused_connections_total"


def _counter(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(COUNTER + " "):
            return float(line.split()[1])
    return 0.0


def test_refusals_are_a_metric_and_a_dead_key_thread_fails_health(tiny_llama) -> None:
    from enginecore.server.app import build_app

    config = make_config(
        model=str(tiny_llama),
        dtype="float32",
        num_blocks_override=64,
        max_model_len=256,
        data_parallel_size=2,
        data_parallel_backend="ray",
        allowed_hosts=["testserver"],
    )
    app = build_app(config)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        dp = app.state.ctx.engine.engine_client
        ports = []
        for engine in dp.engines:
            for sock in (engine.input_socket, engine.output_socket):
                ports.append(int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]))
        before = _counter(client)
        for port in ports:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
                with contextlib.suppress(OSError):
                    raw.recv(64)
        deadline = time.monotonic() + 30
        while _counter(client) - before < len(ports):
            assert time.monotonic() < deadline, _counter(client)
            time.sleep(0.1)
        for rank in (0, 1):
            done = client.post(
                "/v1/completions",
                json={"prompt": [5, 6, 7], "max_tokens": 3, "data_parallel_rank": rank},
            )
            assert done.status_code == 200, done.text
        assert client.get("/health").status_code == 200

        # The seam: the ZAP thread's own control pipe ends it.
        authenticator_for(dp.ctx)._auth.pipe.send(b"TERMINATE")
        deadline = time.monotonic() + 30
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200"
            time.sleep(0.1)
        assert health.status_code == 503
        assert "key-checking (ZAP) thread is dead" in health.text, health.text
