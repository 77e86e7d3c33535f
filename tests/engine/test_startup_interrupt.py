"""Stopping ``enginecore serve`` while it starts: SIGKILL of the frontend leaves no engine
or worker process behind, and Ctrl-C (SIGINT) stops it promptly with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.serve_process import free_port

pytestmark = pytest.mark.slow

#: 130, or death by SIGINT: CPython ends that way when the interrupt passed through code a
#: C extension ran with PyRun_String (torch's imports do), even though it was then caught.
INTERRUPTED = (130, -signal.SIGINT)


def _start_and_wait_for_workers(model, log_path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """``serve`` with the ``mp`` executor; returns once its worker process exists (the model
    is still loading then: nothing listens yet)."""
    port = free_port()
    args = ["serve", str(model), "--port", str(port), "--executor", "mp"]
    args += ["--max-model-len", "256"]
    with open(log_path, "w") as log:
        # Its own process group, as a shell gives a foreground job: Ctrl-C goes to the group.
        proc = subprocess.Popen(
            [sys.executable, "-m", "enginecore.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    frontend = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        descendants = frontend.children(recursive=True)
        workers = [p for p in descendants if p.ppid() != proc.pid]
        if workers:
            return proc, descendants
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the worker never started:\n{log_path.read_text()}")


def _still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        p.kill()
    return alive


def test_sigkill_of_the_frontend_during_startup_leaves_no_process(tiny_llama, tmp_path):
    proc, descendants = _start_and_wait_for_workers(tiny_llama, tmp_path / "log")
    assert "listening on" not in (tmp_path / "log").read_text()  # still starting
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    alive = _still_running(descendants, timeout=5)
    assert not alive, f"left behind: {alive}\n{(tmp_path / 'log').read_text()}"


def test_ctrl_c_during_startup_stops_promptly_with_one_line(tiny_llama, tmp_path):
    log_path = tmp_path / "log"
    proc, descendants = _start_and_wait_for_workers(tiny_llama, log_path)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    started = time.monotonic()
    code = proc.wait(20)
    elapsed = time.monotonic() - started
    log = log_path.read_text()
    assert code in INTERRUPTED, log
    assert elapsed < 10, f"took {elapsed:.1f} s"
    assert "Traceback" not in log, log
    assert "enginecore: interrupted" in log
    assert not _still_running(descendants, timeout=5)


def test_sigint_to_the_frontend_alone_during_startup(tiny_llama, tmp_path):
    log_path = tmp_path / "log"
    proc, descendants = _start_and_wait_for_workers(tiny_llama, log_path)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(20)
    log = log_path.read_text()
    assert code in INTERRUPTED and "Traceback" not in log, log
    assert not _still_running(descendants, timeout=5)
