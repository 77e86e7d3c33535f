"""Run ``enginecore`` CLI servers as real subprocesses in tests: start, wait, stop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(args: list[str], log_path: Path, env: dict[str, str] | None = None):
    """``python -m enginecore.cli ARGS`` with its output in ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "enginecore.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env if env is not None else dict(os.environ),
        )


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float = 240) -> None:
    """Until ``/health`` answers 200; fails the test with the server's log otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url} exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)  # a start is seconds long: a short poll adds little to it
    proc.kill()
    pytest.fail(f"{url} did not become healthy:\n{log_path.read_text()}")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn stops, the engine process with it); SIGKILL if that hangs."""
    proc.send_signal(2)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def serve(
    model: Path | str, log_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``enginecore serve MODEL --port FREE FLAGS...``, healthy: ``(process, url)``."""
    port = free_port()
    proc = start_cli(["serve", str(model), "--port", str(port), *flags], log_path, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
    except BaseException:
        stop(proc)
        raise
    return proc, url


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, stats_path, log_path) -> None:
        self.url = url
        self.proc = proc
        self.stats_path = stats_path
        self.log_path = log_path
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        )

    def post(self, path: str, **kw) -> httpx.Response:
        return self.http.post(path, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.http.get(path, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("enginecore:"):
                    key = sample.name
                    if "finished_reason" in sample.labels:
                        key += f"[{sample.labels['finished_reason']}]"
                    values[key] = values.get(key, 0.0) + sample.value
        return values

    def stats_lines(self) -> list[dict]:
        if not self.stats_path.exists():
            return []
        return [json.loads(line) for line in self.stats_path.read_text().splitlines() if line]

    def finished_records(self) -> dict[str, dict]:
        return {
            f["request_id"]: f for line in self.stats_lines() for f in line["finished_requests"]
        }


API_KEY = "test-secret-key"
