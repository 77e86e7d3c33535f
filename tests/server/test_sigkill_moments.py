"""SIGKILL at odd moments, on real ``enginecore serve`` processes: the engine in the middle
of a long prompt's prefill, a worker in the middle of a collective RPC, the frontend in
the middle of a stream, the engine while it loads the weights. Each time the error is
named, the server exits non-zero, and no process or temporary file is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.helpers.process_kinds import is_kind
from tests.helpers.serve_process import free_port, serve, start_cli

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


def _env(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    return dict(env, TMPDIR=str(tmp)), tmp


def _start(tiny_llama, tmp_path, started, *flags: str):
    env, tmp = _env(tmp_path)
    proc, url = serve(tiny_llama, tmp_path / "server.log", "--dtype", "float32", *flags, env=env)
    started.append(proc)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    return proc, url, tree, tmp


def _kind(tree: list[psutil.Process], kind: str) -> psutil.Process:
    (process,) = [p for p in tree if is_kind(p, kind)]
    return process


def _assert_nothing_left(tree: list[psutil.Process], tmp) -> None:
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    deadline = time.monotonic() + 10
    while any(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp.iterdir()) == [], f"left behind: {list(tmp.iterdir())}"


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("enginecore:num_requests_running")
    )


def _stream(url: str, body: dict, events: list[str]) -> None:
    """The stream's events; ``"<cut>"`` last when the connection dropped mid-stream."""
    try:
        with (
            httpx.Client(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
    except httpx.HTTPError:
        events.append("<cut>")


def test_sigkill_of_the_engine_during_a_long_prefill(tiny_llama, tmp_path, started):
    # 3,000 prompt tokens in 16-token chunks: the prefill spans ~190 steps.
    proc, url, tree, tmp = _start(
        tiny_llama,
        tmp_path,
        started,
        *("--max-model-len", "4096", "--max-num-batched-tokens", "16"),
    )
    events: list[str] = []
    body = {"prompt": [5 + i % 300 for i in range(3000)], "max_tokens": 8}
    thread = threading.Thread(target=_stream, args=(url, body, events))
    thread.start()
    deadline = time.monotonic() + 30
    while _running(url) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(url) == 1 and not events, "the prefill was not under way"
    _kind(tree, "engine").kill()
    thread.join(60)
    assert not thread.is_alive(), "the stream hung"
    assert events[-1] == "[DONE]"
    assert "died" in json.loads(events[-2])["error"]["message"]
    assert proc.wait(60) == 1
    _assert_nothing_left(tree, tmp)


def test_sigkill_of_a_worker_during_a_collective_rpc(tiny_llama, tmp_path, started):
    proc, url, tree, tmp = _start(
        tiny_llama,
        tmp_path,
        started,
        *("--executor", "mp", "--enable-collective-rpc-endpoint", "--max-model-len", "256"),
    )
    worker = _kind(tree, "worker")
    worker.suspend()  # the RPC below waits on it: killed while the RPC is pending
    answers: list[httpx.Response] = []

    def call() -> None:
        body = {"method": "memory_snapshot", "timeout": 60}
        answers.append(httpx.post(f"{url}/collective_rpc", json=body, timeout=90))

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(1.0)
    assert not answers, "the RPC returned while its worker was stopped"
    worker.kill()
    thread.join(90)
    assert answers, "the RPC hung on a dead worker"
    assert answers[0].status_code == 503, answers[0].text
    message = answers[0].json()["error"]["message"]
    assert "rank 0" in message and "died" in message, message
    assert proc.wait(60) == 1
    _assert_nothing_left(tree, tmp)


def test_sigkill_of_the_frontend_mid_stream(tiny_llama, tmp_path, started):
    proc, url, tree, tmp = _start(tiny_llama, tmp_path, started, "--max-model-len", "256")
    events: list[str] = []
    body = {"prompt": "go", "max_tokens": 200, "ignore_eos": True}
    thread = threading.Thread(target=_stream, args=(url, body, events))
    thread.start()
    deadline = time.monotonic() + 30
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(events) >= 3, "the stream did not start"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    thread.join(30)
    assert events[-1] == "<cut>", "the stream went on without its frontend"
    # The engine notices its frontend is gone and exits, cleaning up its IPC directory.
    _assert_nothing_left(tree[1:], tmp)


def test_sigkill_of_the_engine_while_it_loads_the_weights(tiny_llama, tmp_path, started):
    env, tmp = _env(tmp_path)
    log = tmp_path / "server.log"
    args = ["serve", str(tiny_llama), "--port", str(free_port()), "--max-model-len", "256"]
    proc = start_cli(args, log, env)
    started.append(proc)
    frontend = psutil.Process(proc.pid)
    engine = None
    deadline = time.monotonic() + 120
    while engine is None and time.monotonic() < deadline and proc.poll() is None:
        engines = [p for p in frontend.children() if is_kind(p, "engine")]
        engine = engines[0] if engines else None
        time.sleep(0.02)
    assert engine is not None, f"no engine process started:\n{log.read_text()}"
    engine.kill()  # before it ever reports ready: it is importing and loading the model
    status = proc.wait(120)
    assert status != 0
    text = log.read_text()
    assert "engine" in text.lower() and ("died" in text or "exited" in text or "signal" in text)
    _assert_nothing_left([frontend, engine], tmp)
