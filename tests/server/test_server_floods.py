"""One client against everyone else, over real sockets to a real ``enginecore serve``:
slow-header connections, a client filling the queue, and the Responses store filled with
maximal free-form strings. Traffic goes to 127.0.0.1 only, bounded in count and time;
a second client is a second loopback source address (127.0.0.2).
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time

import httpx
import pytest

from tests.helpers.serve_process import serve, stop

MAX_OPEN = 100
PER_ADDRESS = 20  # open connections from one address
HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 3.0
PER_CLIENT = 4
STORE_BYTES = 200_000
MAX_SEQS = 4  # seats in a step


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    log = tmp_path_factory.mktemp("floods") / "server.log"
    proc, url = serve(
        tiny_llama,
        log,
        *("--dtype", "float32", "--max-model-len", "512", "--num-blocks-override", "256"),
        *("--max-open-connections", str(MAX_OPEN)),
        *("--request-header-timeout", str(HEADER_TIMEOUT)),
        *("--request-body-timeout", str(BODY_TIMEOUT)),
        *("--max-open-connections-per-client", str(PER_ADDRESS)),
        *("--max-pending-requests-per-client", str(PER_CLIENT)),
        *("--max-stored-response-bytes", str(STORE_BYTES)),
        *("--scheduling-policy", "fair_share"),
        *("--max-num-seqs", str(MAX_SEQS), "--max-num-seqs-per-client", "2"),
        env=env,
    )
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield {"url": url, "model": model, "port": int(url.rsplit(":", 1)[1])}
    finally:
        stop(proc)


def _complete(server, client: httpx.Client | None = None, **extra) -> httpx.Response:
    body = {"model": server["model"], "prompt": "Hello there", "max_tokens": 4, **extra}
    post = client.post if client is not None else httpx.post
    return post(f"{server['url']}/v1/completions", json=body, timeout=60)


def test_slow_headers_neither_lock_out_new_clients_nor_health_checks(server):
    flood = []
    try:
        for i in range(MAX_OPEN + 30):  # past the limit, within the probes' reserve
            # From seven addresses, each under its own limit: the server's limit is hit.
            source = (f"127.0.0.{3 + i % 7}", 0)
            sock = socket.create_connection(("127.0.0.1", server["port"]), 5, source)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            flood.append(sock)
        started = time.monotonic()
        refused = _complete(server)
        assert refused.status_code == 503, refused.text
        assert refused.headers.get("retry-after") == "1"
        assert "max_open_connections" in refused.json()["error"]["message"]
        assert time.monotonic() - started < 5, "the 503 came at once"
        assert httpx.get(f"{server['url']}/health", timeout=5).status_code == 200
        # The slow clients are disconnected once their header time is up (each recv
        # returns as its connection is closed; the bound is the old fixed wait's).
        deadline = time.monotonic() + HEADER_TIMEOUT + 6.5
        for sock in flood:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            assert sock.recv(1024) == b"", "a slow-header connection was kept open"
        ok = _complete(server)
        assert ok.status_code == 200, ok.text
    finally:
        for sock in flood:
            sock.close()


def _slow_header_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def test_one_address_cannot_hold_every_connection(server):
    from enginecore.server.connection_limits import PROBE_RESERVE

    port = server["port"]
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    held: list[socket.socket] = []
    try:
        held += [_slow_header_socket(port) for _ in range(PER_ADDRESS)]
        refused = _complete(server)  # the address's next request
        assert refused.status_code == 503, refused.text
        assert refused.headers.get("retry-after") == "1"
        assert "max_open_connections_per_client" in refused.json()["error"]["message"]
        assert httpx.get(f"{server['url']}/health", timeout=5).status_code == 200
        # Past the probes' reserve, the address's new connections are closed at once,
        # while those it holds (headers not yet timed out) are still open.
        held += [_slow_header_socket(port) for _ in range(PROBE_RESERVE)]
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(extra)
        assert extra.recv(1) == b"", "a connection past the reserve was accepted"
        assert not _closed_by_server(held[0]), "the held connections were closed"
        # Another address is served all along.
        answer = _complete(server, other)
        assert answer.status_code == 200, answer.text
    finally:
        other.close()
        for sock in held:
            sock.close()


def test_a_trickled_body_is_cut_off_while_others_are_served(server):
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=5)
    length = 10_000
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % length
    )
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    sent, served, cut_off = 1, False, False
    started = time.monotonic()
    try:
        while time.monotonic() - started < BODY_TIMEOUT + 10:  # bounded: 10 s past the limit
            if not served:  # another client, while the trickle runs
                answer = _complete(server, other)
                assert answer.status_code == 200, answer.text
                served = True
            if _closed_by_server(sock):
                cut_off = True
                break
            try:
                sock.sendall(b" ")
            except OSError:
                cut_off = True
                break
            sent += 1
            time.sleep(0.2)
    finally:
        other.close()
        sock.close()
    assert cut_off, "a body trickled past request_body_timeout was kept open"
    assert sent < length and time.monotonic() - started >= BODY_TIMEOUT - 0.5


def test_one_client_cannot_fill_the_queue_for_another(server):
    long = {"max_tokens": 200, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(PER_CLIENT * 2) as pool:
        flood = [pool.submit(_complete, server, **long) for _ in range(PER_CLIENT * 2)]
        answers = [f.result() for f in flood]
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(429) >= PER_CLIENT, statuses
    too_many = next(a for a in answers if a.status_code == 429)
    assert too_many.headers.get("retry-after") == "1"
    assert "max_pending_requests_per_client" in too_many.json()["error"]["message"]

    # While the first client holds its limit, a client at another address is served.
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with concurrent.futures.ThreadPoolExecutor(PER_CLIENT) as pool:
        held = [pool.submit(_complete, server, **long) for _ in range(PER_CLIENT)]
        time.sleep(0.5)
        answer = _complete(server, other)
        assert answer.status_code == 200, answer.text
        assert all(f.result().status_code == 200 for f in held)
    other.close()


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("enginecore:num_requests_running")
    )


def test_a_flooders_seats_make_room_for_another_client(server):
    """One client's long requests hold every seat (``max_num_seqs``): another client's
    short request still runs at once (the flooder's latest is preempted, recomputed
    later) and ends while every long request is still running; those end in full."""
    tokens = 150
    ended: dict[int, float] = {}

    def hold(i: int) -> httpx.Response:
        answer = _complete(server, max_tokens=tokens, ignore_eos=True)
        ended[i] = time.monotonic()
        return answer

    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with concurrent.futures.ThreadPoolExecutor(MAX_SEQS) as pool:
        held = [pool.submit(hold, i) for i in range(MAX_SEQS)]
        deadline = time.monotonic() + 30
        while _running(server["url"]) < MAX_SEQS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(server["url"]) == MAX_SEQS and not ended, "the seats were not all held"
        answer = _complete(server, other)
        other_ended = time.monotonic()
        assert answer.status_code == 200, answer.text
        answers = [f.result() for f in held]
    other.close()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [tokens] * MAX_SEQS
    assert other_ended < min(ended.values()), "the other client waited for a seat"


def test_free_form_strings_count_and_the_responses_store_is_bounded_in_bytes(server):
    url = server["url"]
    big_user = "u" * 300_000  # above max_field_bytes (262,144)
    refused = httpx.post(
        f"{url}/v1/responses",
        json={"model": server["model"], "input": "hi", "max_output_tokens": 2, "user": big_user},
        timeout=60,
    )
    assert refused.status_code == 400, refused.text
    assert "user" in refused.json()["error"]["message"]
    ids = []
    for _ in range(6):  # 6 x ~60 kB > the store's 200 kB
        answer = httpx.post(
            f"{url}/v1/responses",
            json={
                "model": server["model"],
                "input": "hi",
                "max_output_tokens": 2,
                "user": "v" * 60_000,
            },
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["id"])
    assert httpx.get(f"{url}/v1/responses/{ids[0]}", timeout=10).status_code == 404
    assert httpx.get(f"{url}/v1/responses/{ids[-1]}", timeout=10).status_code == 200


def _aborted(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "enginecore:request_success_total"
        and sample.labels.get("finished_reason") == "abort"
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}),
        ("/v1/responses", {"input": "go", "max_output_tokens": 400, "temperature": 0.0}),
    ],
)
def test_a_client_leaving_after_the_first_chunk_aborts_its_request(server, path, body):
    """A chat stream's first chunk (the role) and a response stream's first events come
    before the engine's stream is read: leaving right then must still abort."""
    url = server["url"]
    payload = {"model": server["model"], "max_tokens": 400, "ignore_eos": True, **body}
    if path == "/v1/responses":  # no ignore_eos there: greedy on this model runs long
        del payload["max_tokens"], payload["ignore_eos"]
        whole = httpx.post(f"{url}{path}", json=payload, timeout=120).json()
        assert whole["usage"]["output_tokens"] == 400, whole["usage"]
    before = _aborted(url)
    payload["stream"] = True
    for _ in range(3):
        with httpx.stream("POST", f"{url}{path}", json=payload, timeout=60) as response:
            assert response.status_code == 200, response.read()
            next(response.iter_lines())  # the first event, then hang up
    deadline = time.monotonic() + 10
    while _aborted(url) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborted(url) == before + 3, "the requests ran on after their clients left"
