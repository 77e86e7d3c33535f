"""What crosses the frontend <-> engine sockets: over TCP (how Ray replicas connect) the
engine process unpickles nothing, so whoever can connect cannot make it run code."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys

import msgspec
import pytest
import zmq

from enginecore import make_config
from enginecore.engine.core_proc import HANDSHAKE_READY
from enginecore.engine.mp_client import ENGINE_ENTRY
from enginecore.protocol import EngineCoreOutputs, EngineCoreRequestType
from enginecore.serial import MsgpackDecoder, MsgpackEncoder


class _TouchOnUnpickle:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


@pytest.fixture
def tcp_engine(tiny_llama):
    """The engine process on loopback TCP sockets, as a Ray replica runs it."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    in_port = push.bind_to_random_port("tcp://127.0.0.1")
    out_port = pull.bind_to_random_port("tcp://127.0.0.1")
    config = make_config(model=str(tiny_llama), dtype="float32", stat_loggers=[])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ENGINE_ENTRY,
            f"tcp://127.0.0.1:{in_port}",
            f"tcp://127.0.0.1:{out_port}",
        ],
        stdin=subprocess.PIPE,
    )
    proc.stdin.write(msgspec.msgpack.encode(config))
    proc.stdin.close()
    try:
        assert pull.poll(240_000), "the engine did not answer the handshake"
        assert pull.recv_multipart()[0] == HANDSHAKE_READY
        yield push, pull
    finally:
        proc.terminate()
        proc.wait(30)
        push.close(0)
        pull.close(0)
        ctx.term()


@pytest.mark.slow
def test_a_pickle_sent_over_tcp_is_never_unpickled(tcp_engine, tmp_path) -> None:
    push, pull = tcp_engine
    marker = tmp_path / "code-ran"
    payload = (0, 1, "collective_rpc", (_TouchOnUnpickle(str(marker)), None, (), None))
    frames = MsgpackEncoder(allow_pickle=True).encode(payload)  # what an attacker sends
    push.send_multipart([EngineCoreRequestType.UTILITY.value, *frames])
    assert pull.poll(60_000)
    reply = MsgpackDecoder(EngineCoreOutputs).decode(pull.recv_multipart())
    assert reply.utility_output.call_id == 1
    assert "refused" in reply.utility_output.failure_message
    assert not marker.exists()
    # The engine keeps answering.
    push.send_multipart(
        [EngineCoreRequestType.UTILITY.value, *MsgpackEncoder().encode((0, 2, "ping", ()))]
    )
    assert pull.poll(60_000)
    reply = MsgpackDecoder(EngineCoreOutputs).decode(pull.recv_multipart())
    assert reply.utility_output.call_id == 2 and reply.utility_output.failure_message is None


CURVE_ENGINE = (
    "import sys, msgspec; from enginecore.engine.core_proc import run_engine_core; "
    "keys = msgspec.msgpack.decode(bytes.fromhex(sys.argv[3])); "
    "run_engine_core(sys.stdin.buffer.read(), sys.argv[1], sys.argv[2], 0, keys)"
)


def test_tcp_sockets_admit_only_the_replicas_key(tiny_llama) -> None:
    """The frontend's TCP sockets to a remote replica (data parallelism on Ray) are CURVE
    servers admitting only the key made for that replica: the real engine, given its
    keys, serves; a peer without them (or with another key) reads none of the requests
    and gets nothing into the output stream."""
    from enginecore.engine.wire_auth import (
        CurveKeys,
        authenticator_for,
        secure_server,
        stop_authenticator,
    )

    ctx = zmq.Context()
    keys = CurveKeys.new()
    authenticator_for(ctx).allow(keys.client_public)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    secure_server(push, keys)
    secure_server(pull, keys)
    in_port = push.bind_to_random_port("tcp://127.0.0.1")
    out_port = pull.bind_to_random_port("tcp://127.0.0.1")
    intruders = zmq.Context()
    reader = intruders.socket(zmq.PULL)  # would take a share of PUSH's round robin
    reader.connect(f"tcp://127.0.0.1:{in_port}")
    forger = intruders.socket(zmq.PUSH)
    other = CurveKeys.new()  # a valid CURVE client, with a key nobody registered
    forger.curve_serverkey = keys.server_public
    forger.curve_publickey, forger.curve_secretkey = other.client_public, other.client_secret
    forger.connect(f"tcp://127.0.0.1:{out_port}")
    config = make_config(model=str(tiny_llama), dtype="float32", stat_loggers=[])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CURVE_ENGINE,
            f"tcp://127.0.0.1:{in_port}",
            f"tcp://127.0.0.1:{out_port}",
            msgspec.msgpack.encode(keys.for_client()).hex(),
        ],
        stdin=subprocess.PIPE,
    )
    proc.stdin.write(msgspec.msgpack.encode(config))
    proc.stdin.close()
    try:
        assert pull.poll(240_000), "the engine did not answer the handshake"
        assert pull.recv_multipart()[0] == HANDSHAKE_READY
        with contextlib.suppress(zmq.Again):  # queued at best: its handshake fails
            forger.send(b"forged output", flags=zmq.NOBLOCK)
        for call_id in range(1, 6):
            frames = MsgpackEncoder().encode((0, call_id, "ping", ()))
            push.send_multipart([EngineCoreRequestType.UTILITY.value, *frames])
        answered = set()
        # A forged output, had its peer been admitted, was sent before the pings and comes
        # ahead of their answers (sent through the engine): a short wait after them is enough.
        while pull.poll(500 if len(answered) == 5 else 60_000):
            frames = pull.recv_multipart()
            assert frames != [b"forged output"], "an unauthenticated peer wrote to the output"
            answered.add(MsgpackDecoder(EngineCoreOutputs).decode(frames).utility_output.call_id)
        assert answered == {1, 2, 3, 4, 5}  # every request reached the engine
        assert not reader.poll(500), "an unauthenticated peer read a request"
    finally:
        proc.terminate()
        proc.wait(30)
        for sock in (push, pull):
            sock.close(0)
        for sock in (reader, forger):
            sock.close(0)
        stop_authenticator(ctx)
        ctx.term()
        intruders.term()


def test_a_message_with_an_unknown_tag_is_dropped_and_the_engine_serves_on(tcp_engine) -> None:
    """0x02 (once a reserved wave tag, never handled) and a tag no version uses."""
    push, pull = tcp_engine
    ping = MsgpackEncoder().encode((0, 7, "ping", ()))
    for tag in (b"\x02", b"\xff"):
        push.send_multipart([tag, *ping])
    push.send_multipart([EngineCoreRequestType.UTILITY.value, *ping])
    assert pull.poll(60_000), "the engine stopped reading its input"
    reply = MsgpackDecoder(EngineCoreOutputs).decode(pull.recv_multipart())
    assert reply.utility_output.call_id == 7 and reply.utility_output.failure_message is None
    assert not pull.poll(500)  # the dropped messages were not answered
