"""What a data-parallel deployment on Ray listens on, and what an attacker gets from it.

Two replicas on a private Ray cluster, each running its TP=2 ranks with the ``ray``
executor. Every listening socket in the processes enginecore runs (the frontend, each
replica's engine-core actor, each rank actor) is either Ray's own (a core worker's gRPC
server: Ray's, token-authenticated) or bound to loopback: the replicas' rendezvous takes
no TCP port on any other interface (a torch TCP store would accept anyone who reaches
it). The frontend's CURVE sockets then take junk bytes, a ZeroMQ peer without keys, a
peer with a key nobody registered and a flood of held connections; the replicas still
serve every request exactly, and no forged frame reaches the frontend.
"""

from __future__ import annotations

import contextlib
import socket

import psutil
import pytest
import zmq

from enginecore import LLM, SamplingParams
from enginecore.engine.wire_auth import CurveKeys
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LOOPBACK = ("127.0.0.1", "::1")
OUR_ACTORS = ("EngineCoreActor", "EngineCoreRankActor")


def _our_processes() -> list[psutil.Process]:
    me = psutil.Process()
    procs = [me]
    for proc in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(name in " ".join(proc.cmdline()) for name in OUR_ACTORS):
                procs.append(proc)
    return procs


def _ray_core_worker_ports() -> set[int]:
    """The gRPC ports of Ray's core workers in our processes (each actor's and, as the
    owner of the replica actors, the frontend's)."""
    from ray._private import state

    ports: set[int] = set()
    for actor in state.actors().values():
        ports.add(actor["Address"]["Port"])
        ports.add(actor["OwnerAddress"]["Port"])
    return ports


def _listeners(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    found = []
    for proc in procs:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((proc.name(), conn.laddr.ip, conn.laddr.port))
    return found


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_blocks_override=64,
        max_model_len=256,
        data_parallel_size=2,
        data_parallel_backend="ray",
        executor="ray",
        tensor_parallel_size=2,
    )
    try:
        yield llm
    finally:
        llm.shutdown()


def _check_serving(llm, tiny_llama, seed: int) -> None:
    prompts = mixed_prompts(seed)[:4]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(tiny_llama, prompt, 6), "ray dp ports"
        )
    for rank in (0, 1):
        pinned = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, data_parallel_rank=rank)
        assert pinned[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_only_loopback_ports_besides_rays_own(dp_llm, tiny_llama) -> None:
    _check_serving(dp_llm, tiny_llama, 11)
    procs = _our_processes()
    ranks = [p for p in procs if "EngineCoreRankActor" in " ".join(p.cmdline())]
    assert len(ranks) == 4, "expected two replicas of two rank actors each"
    ray_ports = _ray_core_worker_ports()
    exposed = [
        (name, ip, port)
        for name, ip, port in _listeners(procs)
        if ip not in LOOPBACK and port not in ray_ports
    ]
    assert not exposed, f"listening beyond loopback, unauthenticated: {exposed}"


def _frontend_tcp_ports(llm) -> list[int]:
    ports = []
    for engine in llm.engine_client.engines:
        for sock in (engine.input_socket, engine.output_socket):
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
            ports.append(int(endpoint.rsplit(":", 1)[1]))
    return ports


def test_frontend_sockets_survive_junk_spoofed_peers_and_a_connection_flood(
    dp_llm, tiny_llama
) -> None:
    ports = _frontend_tcp_ports(dp_llm)
    assert len(ports) == 4
    intruders = zmq.Context()
    held: list[socket.socket] = []
    peers: list[zmq.Socket] = []
    try:
        for port in ports:
            # Raw junk, then a connection left open (the flood: 100 per port).
            for i in range(100):
                raw = socket.create_connection(("127.0.0.1", port), timeout=5)
                if i % 10 == 0:
                    raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
                held.append(raw)
            # A ZeroMQ peer without CURVE keys and one with a key nobody registered.
            for keys in (None, CurveKeys.new()):
                for kind in (zmq.PUSH, zmq.PULL):
                    peer = intruders.socket(kind)
                    peer.setsockopt(zmq.LINGER, 0)
                    if keys is not None:
                        peer.curve_serverkey = keys.server_public  # a guess: wrong server
                        peer.curve_publickey = keys.client_public
                        peer.curve_secretkey = keys.client_secret
                    peer.connect(f"tcp://127.0.0.1:{port}")
                    if kind == zmq.PUSH:
                        with contextlib.suppress(zmq.Again):
                            peer.send_multipart([b"\x01", b"forged"], flags=zmq.NOBLOCK)
                    peers.append(peer)
        # Every replica still serves, exactly, with the flood held open.
        _check_serving(dp_llm, tiny_llama, 12)
        for peer in peers:
            if peer.type == zmq.PULL:
                assert not peer.poll(200), "an unauthenticated peer read a request"
    finally:
        for raw in held:
            raw.close()
        for peer in peers:
            peer.close(0)
        intruders.term()
    _check_serving(dp_llm, tiny_llama, 13)
