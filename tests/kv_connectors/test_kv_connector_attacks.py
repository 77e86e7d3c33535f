"""A ``zmq_p2p`` server (``kv_both``: producer and consumer at once) under attack, over
real sockets: hostile ``kv_transfer_params`` over HTTP, a client naming its own peer,
junk frames and a flood of GETs on the block server (a real ZeroMQ DEALER holding the
instance's secret), a spoofed producer feeding another prompt's blocks, and a dead block
server thread turning the health check red. After each attack, a normal request and a
full prefill -> decode hand-off on the same server still work.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import httpx
import msgspec
import pytest
import torch
import zmq

from enginecore import LLM
from enginecore.config import make_config
from enginecore.engine.wire_auth import keys_from_secret, secure_client, secure_server
from enginecore.testing.kv_connector_contract import free_port
from tests.helpers.serve_process import serve, stop

SECRET = "the instance's secret, known to the attacker of the block server tests"
PROMPT = (
    "The history of the city begins with a small fishing village on the river bank, where "
    "boats came and went with the tides and the market opened every morning at dawn"
)


@pytest.fixture(scope="module")
def kv_server(tiny_llama, tmp_path_factory):
    kv_port = free_port()
    # Default bounds: 64 GETs waiting per peer, 1,024 in all.
    extra = {"port": kv_port, "secret": SECRET, "recv_timeout": 5, "send_timeout": 30}
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    log = tmp_path_factory.mktemp("kv_attacks") / "server.log"
    proc, url = serve(
        tiny_llama,
        log,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--num-blocks-override",
        "200",
        "--kv-connector",
        "zmq_p2p",
        "--kv-role",
        "kv_both",
        "--kv-connector-extra-config",
        json.dumps(extra),
        env=env,
    )
    try:
        yield {"url": url, "kv_port": kv_port, "log": log}
    finally:
        stop(proc)


def _complete(url: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _assert_serving(url: str) -> None:
    """The engine answers health checks and requests, and a full hand-off still works:
    the prefill's handle fetched back from the block server gives the same tokens."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    model = _model(url)
    plain = _complete(url, model=model)
    assert plain.status_code == 200, plain.text
    prefill = _complete(
        url, model=model, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    assert prefill.status_code == 200, prefill.text
    handle = prefill.json()["kv_transfer_params"]
    assert handle["num_tokens"] >= 16, handle
    decode = _complete(url, model=model, kv_transfer_params=handle)
    assert decode.status_code == 200, decode.text
    assert decode.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _handle(kv_port: int, **overrides) -> dict:
    handle = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": kv_port,
        "remote_request_id": "cmpl-x",
        "num_tokens": 32,
    }
    handle.update(overrides)
    return {k: v for k, v in handle.items() if v is not None}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_tokens": "abc"}, "num_tokens"),
        ({"remote_host": None}, "remote_host"),
        ({"remote_port": 1 << 40}, "remote_port"),
        ({"remote_request_id": ["a"]}, "remote_request_id"),
        ({"unexpected": 1}, "unexpected"),
    ],
)
def test_hostile_kv_transfer_params_are_a_400_naming_the_field(kv_server, overrides, field):
    url = kv_server["url"]
    answer = _complete(
        url, model=_model(url), kv_transfer_params=_handle(kv_server["kv_port"], **overrides)
    )
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"], answer.text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_a_client_cannot_choose_the_peer_the_instance_connects_to(kv_server):
    url = kv_server["url"]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(3.0)
        port = listener.getsockname()[1]
        answer = _complete(url, model=_model(url), kv_transfer_params=_handle(port))
        assert answer.status_code == 400, answer.text
        assert "not a configured peer" in answer.json()["error"]["message"]
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected to the address the client named
    _assert_serving(url)


def _dealer(context: zmq.Context, kv_port: int, secret: str | None = SECRET) -> zmq.Socket:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secure_client(dealer, keys_from_secret(secret, "zmq_p2p").for_client())
    dealer.connect(f"tcp://127.0.0.1:{kv_port}")
    return dealer


def test_junk_frames_get_an_error_and_the_block_server_keeps_serving(kv_server):
    context = zmq.Context()
    try:
        dealer = _dealer(context, kv_server["kv_port"])
        junk = [
            [b"junk"],
            [b"", b"\xc1 not msgpack"],
            [b"", b"a", b"b"],
            [b"", msgspec.msgpack.encode({"x": 1})],
        ]
        for frames in junk:
            dealer.send_multipart(frames)
            assert dealer.poll(5000), "the block server did not answer a malformed frame"
            reply = dealer.recv_multipart()
            assert reply[:2] == [b"", b"ERR"] and b"malformed" in reply[2], reply
        dealer.close()
    finally:
        context.destroy(linger=0)
    _assert_serving(kv_server["url"])
    log = kv_server["log"].read_text()
    assert log.count("malformed message from") == 1, "logged once per peer"
    assert _metric(kv_server["url"], "enginecore:kv_connector_rejected_messages_total") >= 4


def test_a_flood_of_gets_is_refused_beyond_the_per_peer_bound(kv_server):
    context = zmq.Context()
    try:
        dealer = _dealer(context, kv_server["kv_port"])
        for i in range(200):
            get = msgspec.msgpack.encode([f"never-held-{i}", 0, ["k"]])
            dealer.send_multipart([b"", get])
        refused = 0
        deadline = time.monotonic() + 5
        while refused < 136 and time.monotonic() < deadline:
            if dealer.poll(200):
                reply = dealer.recv_multipart()
                assert reply[1] == b"ERR", reply
                refused += b"too many requests waiting" in reply[2]
        assert refused == 136, f"{refused} GETs refused at once; 64 are kept"
        dealer.close()
    finally:
        context.destroy(linger=0)
    _assert_serving(kv_server["url"])


def test_an_unauthenticated_peer_gets_nothing_through(kv_server):
    context = zmq.Context()
    try:
        for secret in (None, "another secret"):
            dealer = _dealer(context, kv_server["kv_port"], secret)
            dealer.send_multipart([b"", msgspec.msgpack.encode(["cmpl-x", 0, ["k"]])])
            assert not dealer.poll(1500), "a peer without the secret got an answer"
            dealer.close()
    finally:
        context.destroy(linger=0)


def test_loopback_instances_authenticate_with_a_generated_owner_only_secret(tmp_path, monkeypatch):
    from enginecore_kv_connectors.zmq_p2p import P2PSettings

    monkeypatch.delenv("ENGINECORE_KV_SECRET", raising=False)
    path = tmp_path / "conf" / "kv.secret"
    monkeypatch.setenv("ENGINECORE_KV_SECRET_FILE", str(path))

    def settings(role: str) -> P2PSettings:
        config = make_config(model="x", kv_transfer={"connector": "zmq_p2p", "role": role})
        return P2PSettings.of(config)

    producer, consumer = settings("kv_producer"), settings("kv_consumer")
    assert producer.secret and len(producer.secret) >= 32
    assert consumer.secret == producer.secret, "both instances derive the same keys"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(Exception, match="readable by no one else"):
        settings("kv_consumer")


def test_blocks_of_another_prompt_from_a_spoofing_producer_never_enter_the_cache(
    monkeypatch,
):
    """A peer holding the secret answers a GET with a well-formed block of another
    prefix: the consumer reports it invalid (recomputed) and leaves its cache alone."""
    from enginecore_kv_connectors.kv_blocks import KVLayout, encode_block, prefix_keys
    from enginecore_kv_connectors.zmq_p2p import FetchJob, ZmqP2PWorker

    port = free_port()
    extra = {"secret": SECRET, "recv_timeout": 5.0, "peers": [f"127.0.0.1:{port}"]}
    config = make_config(
        model="unused",
        kv_transfer={"connector": "zmq_p2p", "role": "kv_consumer", "extra_config": extra},
    )
    consumer = ZmqP2PWorker(config, 0)
    caches = {f"layer.{i}": torch.zeros(2, 4, 16, 2, 8) for i in range(2)}
    consumer.register_kv_caches(caches)
    layout = KVLayout.of(list(caches.values()))
    context = zmq.Context()
    spoof = context.socket(zmq.ROUTER)
    spoof.setsockopt(zmq.LINGER, 0)
    from enginecore.engine.wire_auth import authenticator_for, stop_authenticator

    keys = keys_from_secret(SECRET, "zmq_p2p")
    authenticator_for(context).allow(keys.client_public)
    secure_server(spoof, keys)
    spoof.bind(f"tcp://127.0.0.1:{port}")
    try:
        wanted = prefix_keys(list(range(16)), 16)
        other = prefix_keys(list(range(100, 116)), 16)
        job = FetchJob("r", "127.0.0.1", port, "remote", 0, [1], wanted)
        future = consumer._pool.submit(consumer._fetch, job)
        assert spoof.poll(5000)
        identity, _, _ = spoof.recv_multipart()
        block = torch.ones(layout.shape)
        spoof.send_multipart([identity, b"", b"OK", encode_block(layout, block, other[0])])
        future.result(timeout=10)
        assert consumer.get_block_ids_with_load_errors() == {1}
        assert all(not cache.any() for cache in caches.values()), "foreign KV entered the cache"
    finally:
        consumer.shutdown()
        spoof.close()
        stop_authenticator(context)
        context.destroy(linger=0)


def test_a_dead_block_server_thread_fails_the_engine_health_check(tiny_llama):
    with LLM(
        str(tiny_llama),
        multiprocessing=False,
        dtype="float32",
        num_blocks_override=64,
        kv_transfer={
            "connector": "zmq_p2p",
            "role": "kv_producer",
            "extra_config": {"port": free_port(), "secret": SECRET},
        },
    ) as llm:
        engine = llm.engine_client.engine
        assert engine.ping() == "pong"
        bridge = engine.executor.collective_rpc(_connector_server_of_rank)[0]
        assert bridge == "alive"
        engine.executor.collective_rpc(_stop_connector_server)
        with pytest.raises(Exception, match=r"KV block server on .* stopped"):
            engine.ping()


def _connector_server_of_rank(worker) -> str:
    return "alive" if worker.model_runner.kv_connector.connector.server.alive else "dead"


def _stop_connector_server(worker) -> None:
    server = worker.model_runner.kv_connector.connector.server
    server._stop.set()
    server.thread.join(5)
