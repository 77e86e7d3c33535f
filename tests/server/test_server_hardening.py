"""Attacks on a real ``enginecore serve`` (tiny model, loopback): no request may kill,
freeze or crash the server; each one gets a 4xx naming the limit, and the same keep-alive
connection keeps serving.

The server is the server/ folder's ``guarded_server`` (the vLLM-parity module sends it
requests too): a test that stops, pauses or puts its engine to sleep leaves it serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.process_kinds import is_kind
from tests.helpers.shared_server import GUARDED_MAX_PENDING as MAX_PENDING
from tests.helpers.shared_server import GUARDED_MAX_PROMPT_TOKENS as MAX_PROMPT_TOKENS


@pytest.fixture(scope="module")
def served(guarded_server):
    url = guarded_server.url()  # started (again) first: the process is the running one's
    return guarded_server.proc, url


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[1]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def _ok(http: httpx.Client) -> None:
    """The server still generates (on the same connection)."""
    response = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def _schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "body",
    [
        {"metadata": _nested(500)},
        {"kv_transfer_params": _nested(500)},
        {"guided_json": _schema(245)},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": _schema(245)}}},
    ],
    ids=["metadata", "kv_transfer_params", "guided_json", "response_format"],
)
def test_deep_nesting_is_a_400_and_the_engine_lives(http, body) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert "max_json_depth=32" in response.json()["error"]["message"]
    _ok(http)


def test_deep_nesting_in_chat_tools_is_a_400(http) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": _schema(100)}}
    response = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "tools": [tool]},
    )
    assert response.status_code == 400
    assert "max_json_depth" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"metadata": {"blob": "x" * 300_000}}, "max_field_bytes=262144"),
        ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "max_logit_bias_entries=1024"),
        ({"prompt": ["a"] * 257}, "max_prompts_per_request=256"),
        ({"prompt": [[5] * 1500] * 3}, f"max_prompt_tokens_per_request={MAX_PROMPT_TOKENS}"),
        ({"prompt": ["hello world " * 700] * 3}, "max_prompt_tokens_per_request"),
    ],
    ids=["field-size", "logit-bias", "prompts", "token-ids", "text-tokens"],
)
def test_request_limits_name_the_limit(http, body, limit) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    assert limit in response.json()["error"]["message"]
    _ok(http)


def test_too_many_tools_is_a_400(http) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    response = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "tools": tools},
    )
    assert response.status_code == 400
    assert "max_tools=128" in response.json()["error"]["message"]


RAW_BAD_BODIES = [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 18446744073709551616}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_k": 99999999999999999999999}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "priority": 18446744073709551617}'),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "metadata": {"k": "\\udfff"}}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/tokenize", '{"prompt": "\\ud800"}'),
]


def test_bad_values_are_400_and_keep_the_connection(http) -> None:
    for path, raw in RAW_BAD_BODIES:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (raw, response.status_code, response.text)
        assert response.headers.get("connection") != "close", raw
    _ok(http)


@pytest.mark.slow
def test_health_answers_while_a_huge_prompt_is_tokenized(server, http) -> None:
    prompt = " ".join(f"w{i}" for i in range(500_000))  # about 3.8 MB of text
    result: dict = {}

    def tokenize() -> None:
        with httpx.Client(base_url=server, timeout=120) as other:
            result["response"] = other.post("/tokenize", json={"prompt": prompt})

    worker = threading.Thread(target=tokenize)
    worker.start()
    latencies = []
    try:
        time.sleep(0.3)  # the body is uploaded and tokenizing
        while worker.is_alive() and len(latencies) < 40:
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    finally:
        worker.join()
    assert result["response"].status_code == 200
    assert result["response"].json()["count"] > 100_000
    assert len(latencies) >= 3, "tokenization finished before /health could be probed"
    # The median within 100 ms (the machine running the test may be shared); a blocked
    # event loop would hold every probe for the whole tokenization (seconds).
    assert sorted(latencies)[len(latencies) // 2] < 0.1, latencies
    assert max(latencies) < 1.0, latencies


def test_a_deep_body_beyond_the_parser_is_still_a_400(http) -> None:
    raw = '{"prompt": "hi", "metadata": ' + "[" * 5000 + "]" * 5000 + "}"
    response = http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    json.loads(response.text)  # an OpenAI-style JSON error body
    _ok(http)


def _engine_process(server_proc) -> psutil.Process:
    (engine,) = [p for p in psutil.Process(server_proc.pid).children() if is_kind(p, "engine")]
    return engine


def test_a_saturated_server_answers_503_with_retry_after(served, http) -> None:
    server_proc, url = served
    engine = _engine_process(server_proc)
    release = threading.Event()
    statuses: list[int] = []
    opened = threading.Semaphore(0)

    def hold_a_stream() -> None:
        body = {"prompt": "go", "max_tokens": 50, "stream": True}
        with (
            httpx.Client(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            statuses.append(response.status_code)
            opened.release()
            release.wait(60)  # leaving the block disconnects: the request is aborted

    # A stopped engine makes no progress: the streams stay unfinished however fast the
    # model, and the server must refuse more instead of queueing them.
    engine.suspend()
    holders = [threading.Thread(target=hold_a_stream) for _ in range(MAX_PENDING)]
    for holder in holders:
        holder.start()
    try:
        for _ in holders:  # every stream admitted before the one that must be refused
            assert opened.acquire(timeout=30), "a stream was never answered"
        assert statuses == [200] * MAX_PENDING, statuses
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "the server never refused a request"
            try:
                response = http.post("/v1/completions", json={"prompt": "hi"}, timeout=2)
            except httpx.ReadTimeout:
                continue  # admitted before every stream was; the disconnect aborts it
            break
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert f"max_pending_requests={MAX_PENDING}" in response.json()["error"]["message"]
        # Counted as vLLM counts a full queue (/metrics answers while the engine is stopped).
        families = text_string_to_metric_families(http.get("/metrics").text)
        rejections = [
            s.value
            for f in families
            for s in f.samples
            if s.name == "enginecore:admission_rejections_total"
            and s.labels["reason"] == "max_num_queued_reqs"
        ]
        assert rejections and rejections[0] >= 1
    finally:
        engine.resume()
        release.set()
        for holder in holders:
            holder.join()
    # The disconnected streams are aborted as the server notices; then it serves again.
    deadline = time.monotonic() + 30
    while http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code != 200:
        assert time.monotonic() < deadline, "the aborted streams never freed their slots"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("stop", "start"), [("/pause?mode=keep", "/resume"), ("/sleep?level=1", "/wake_up")]
)
def test_paused_or_asleep_new_requests_get_503_not_a_hang(http, stop, start) -> None:
    assert http.post(stop).status_code == 200
    try:
        for stream in (False, True):
            body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
            response = http.post("/v1/completions", json=body, timeout=10)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert "retry after it resumes" in response.json()["error"]["message"]
    finally:
        assert http.post(start).status_code == 200
    _ok(http)


def test_a_web_page_cannot_drive_the_control_routes(server, http) -> None:
    # What a page can send cross-site without a CORS preflight: text/plain, a form.
    for headers in (
        {"content-type": "text/plain"},
        {"content-type": "application/x-www-form-urlencoded"},
    ):
        response = http.post("/reset_prefix_cache", content=b"x", headers=headers)
        assert response.status_code == 415, response.text
        assert "application/json" in response.json()["error"]["message"]
    evil = {"origin": "http://evil.example"}
    response = http.post("/pause", headers=evil)
    assert response.status_code == 403, response.text
    assert "allowed_origins" in response.json()["error"]["message"]
    assert http.get("/is_paused").json() == {"is_paused": False}
    response = http.post("/v1/completions", json={"prompt": "hi"}, headers=evil)
    assert response.status_code == 403
    _ok(http)


def test_dns_rebinding_host_is_refused(http) -> None:
    response = http.get("/v1/models", headers={"host": "evil.example:8000"})
    assert response.status_code == 400
    assert "allowed_hosts" in response.json()["error"]["message"]
    assert http.get("/v1/models", headers={"host": "localhost:8000"}).status_code == 200


def test_a_request_chat_template_is_refused_unless_trusted(http) -> None:
    # Two nested loops: 10^10 iterations would hold a server thread for hours.
    bomb = "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}{% endfor %}{% endfor %}"
    response = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template": bomb},
        timeout=15,
    )
    assert response.status_code == 400, response.text
    assert "--trust-request-chat-template" in response.json()["error"]["message"]
    _ok(http)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"return_tensors": "np"},  # was a 500
        {"padding": "max_length", "max_length": 100_000_000},  # 10^8 tokens for 100 bytes
        {"sanitize_control_tokens": False},
        {"tokenize": False},
    ],
)
@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_chat_template_kwargs_cannot_steer_the_tokenizer(http, kwargs, route) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    extra = {"max_tokens": 2} if route.startswith("/v1") else {}
    response = http.post(route, json={**body, **extra}, timeout=30)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and next(iter(kwargs)) in error["message"]
    # Template variables still reach the template.
    variables = {**body, "chat_template_kwargs": {"documents": [{"title": "t"}], "x": 1}}
    assert http.post("/tokenize", json=variables).status_code == 200
