"""A data-parallel replica on Ray whose actor is gone before its handshake.

The handshake is the local engine's; the reason it reports comes from the Ray replica, which
has no local process: the error is an ``EngineDeadError`` that names the actor.
"""

from __future__ import annotations

import pytest
import zmq

from enginecore.engine.dp_ray import RayEngine
from enginecore.errors import EngineDeadError


def test_ray_replica_gone_before_handshake_raises_engine_dead_error() -> None:
    ctx = zmq.Context()
    # Only the handshake's state: a replica whose actor has ended (no run ref) and an output
    # socket nothing answers on. Starting a Ray cluster adds nothing to this path.
    engine = RayEngine.__new__(RayEngine)
    engine._run_ref = None
    engine.pid, engine.node_id = 4242, "0123456789abcdef"
    engine.output_socket = ctx.socket(zmq.PULL)
    engine.output_socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(EngineDeadError, match=r"engine core actor \(pid 4242"):
            engine.handshake(timeout=5)
    finally:
        engine.output_socket.close(linger=0)
        ctx.term()
