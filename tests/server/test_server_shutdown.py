"""How ``enginecore serve`` ends, on a real server process: SIGTERM drains (streams end
with their last event and ``[DONE]``, the engine and its temporary directory go, exit 0);
an engine that dies takes the server down with a non-zero status after failing what was
in flight."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import psutil
import pytest

from tests.helpers.process_kinds import is_kind
from tests.helpers.serve_process import serve

pytestmark = pytest.mark.slow


@pytest.fixture
def started():
    """Processes to kill if a test fails before its server exits."""
    procs: list = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _start(tiny_llama, tmp_path, started, *flags: str):
    """A server whose temporary files go to a directory of the test's own."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    proc, url = serve(
        tiny_llama,
        tmp_path / "server.log",
        "--dtype",
        "float32",
        "--stat-loggers",
        "",
        *flags,
        env=env,
    )
    started.append(proc)
    (engine,) = [p for p in psutil.Process(proc.pid).children() if is_kind(p, "engine")]
    return proc, url, engine, tmp


def _stream_events(url: str, body: dict, first_event: threading.Event, events: list) -> None:
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                first_event.set()


def _run_streams(url: str, bodies: list[dict]):
    results: list[list[str]] = [[] for _ in bodies]
    started = [threading.Event() for _ in bodies]
    threads = [
        threading.Thread(target=_stream_events, args=(url, body, started[i], results[i]))
        for i, body in enumerate(bodies)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60), "a stream never started"
    return threads, results


def _assert_clean_exit(proc, engine, tmp, status: int) -> None:
    assert proc.wait(60) == status, f"exit status {proc.returncode}"
    psutil.wait_procs([engine], timeout=15)
    assert not engine.is_running(), "the engine process outlived the server"
    assert list(tmp.iterdir()) == [], f"left behind: {list(tmp.iterdir())}"


def test_sigterm_aborts_streams_with_an_error_event_and_done(tiny_llama, tmp_path, started) -> None:
    proc, url, engine, tmp = _start(tiny_llama, tmp_path, started, "--shutdown-timeout", "0")
    body = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True}
    threads, results = _run_streams(url, [body, body])
    proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    for events in results:
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"], error
    _assert_clean_exit(proc, engine, tmp, 0)


def test_sigterm_lets_in_flight_requests_finish_within_the_timeout(
    tiny_llama, tmp_path, started
) -> None:
    proc, url, engine, tmp = _start(tiny_llama, tmp_path, started, "--shutdown-timeout", "60")
    body = {"prompt": "go", "max_tokens": 40, "ignore_eos": True}
    threads, results = _run_streams(url, [body])
    proc.send_signal(signal.SIGTERM)
    threads[0].join(60)
    events = results[0]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length", last
    text_events = [json.loads(e) for e in events[:-1]]
    assert sum(len(e["choices"]) for e in text_events) >= 2
    _assert_clean_exit(proc, engine, tmp, 0)


def test_when_the_engine_dies_the_server_exits_non_zero(tiny_llama, tmp_path, started) -> None:
    proc, url, engine, _ = _start(tiny_llama, tmp_path, started)
    body = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True}
    threads, results = _run_streams(url, [body])
    engine.kill()
    threads[0].join(60)
    events = results[0]
    assert events[-1] == "[DONE]"
    assert "died" in json.loads(events[-2])["error"]["message"]
    assert proc.wait(60) == 1
