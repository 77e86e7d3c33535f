"""The frontend's data-parallel TCP sockets count and log the peers they refuse.

Real CURVE server sockets set up as a Ray replica's (``secure_server``, the context's ZAP
authenticator, ``watch``), real peers: junk bytes, a ZeroMQ peer without keys, one that
guesses the server key, one with the right server key and an unregistered client key.
Each is refused and counted (``enginecore:data_parallel_refused_connections_total``),
the log holds one line for the flood, the replica's own key still gets through, and a
dead key-checking thread is reported (what ``/health`` turns into a 503; the served
check is in ``test_data_parallel_ray_health.py``)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import prometheus_client
import pytest
import zmq

from enginecore.engine.wire_auth import (
    CurveKeys,
    authenticator_for,
    authenticator_problem,
    secure_client,
    secure_server,
    stop_authenticator,
)

COUNTER = "enginecore:data_parallel_refused_connections_total"


def counted() -> float:
    return prometheus_client.REGISTRY.get_sample_value(COUNTER) or 0.0


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def frontend():
    ctx = zmq.Context()
    keys = CurveKeys.new()
    auth = authenticator_for(ctx)
    auth.allow(keys.client_public)
    server = ctx.socket(zmq.PULL)
    server.setsockopt(zmq.LINGER, 0)
    secure_server(server, keys)
    auth.watch(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield ctx, keys, auth, server, port
    finally:
        server.close(0)
        stop_authenticator(ctx)
        ctx.term()


def test_refused_peers_are_counted_logged_once_and_the_replica_gets_through(frontend, caplog):
    ctx, keys, auth, server, port = frontend
    caplog.set_level(logging.WARNING, logger="enginecore.engine.refused_peers")
    before = counted()
    peers = zmq.Context()
    try:
        for _ in range(5):  # junk bytes
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
                with contextlib.suppress(OSError):
                    raw.recv(64)
        strangers = [
            None,  # no CURVE at all
            {**CurveKeys.new().for_client()},  # a guessed server key
            {**CurveKeys.new().for_client(), "server_public": keys.server_public},  # unknown
        ]
        for client_keys in strangers:
            peer = peers.socket(zmq.PUSH)
            peer.setsockopt(zmq.LINGER, 0)
            secure_client(peer, client_keys)
            peer.connect(f"tcp://127.0.0.1:{port}")
            with contextlib.suppress(zmq.Again):
                peer.send(b"forged", flags=zmq.NOBLOCK)
        wait_for(lambda: auth.refused.total >= 8)  # the strangers retry: at least one each
        peers.destroy(0)
        peers = zmq.Context()
        time.sleep(0.3)  # the last refusals land
        assert counted() - before == auth.refused.total
        # The replica's own key is admitted; nothing forged was read.
        replica = peers.socket(zmq.PUSH)
        replica.setsockopt(zmq.LINGER, 0)
        secure_client(replica, keys.for_client())
        replica.connect(f"tcp://127.0.0.1:{port}")
        replica.send(b"from the replica")
        assert server.poll(10_000)
        assert server.recv() == b"from the replica"
        assert not server.poll(200)
    finally:
        peers.destroy(0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # the flood is one line (then at most one a minute)
    assert f"tcp://127.0.0.1:{port}" in lines[0] and COUNTER in lines[0], lines
    assert authenticator_problem(ctx) is None


def test_a_dead_key_checking_thread_is_reported(frontend):
    ctx, _, auth, _, _ = frontend
    assert authenticator_problem(ctx) is None
    # The seam: the ZAP thread's own control pipe ends it, its socket left as it was.
    auth._auth.pipe.send(b"TERMINATE")
    wait_for(lambda: authenticator_problem(ctx) is not None)
    assert "key-checking (ZAP) thread is dead" in str(authenticator_problem(ctx))
    # Shutting down after that death does not block on the dead thread's control pipe.
    stopper = threading.Thread(target=stop_authenticator, args=(ctx,), daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "stopping the authenticator hung"
