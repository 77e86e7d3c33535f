"""What crosses the frontend <-> engine sockets: over TCP (how Ray replicas connect) the
engine process unpickles nothing, so whoever can connect cannot make it run code."""

from __future__ import annotations

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
