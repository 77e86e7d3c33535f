"""``enginecore bench compare --workload serving``: each turn's server, started and stopped.

A turn's server is stopped with every process of its group (a peer's engine process can
outlive its API server), its readiness is an answer from that server and not from
whatever else holds the port, and the serving rounds run one after the other.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
import time
import urllib.request

import psutil
import pytest

from enginecore.bench import compare
from tests.helpers.serve_process import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A leader that exits at once on SIGTERM and a child (same group) that takes 2 s to.
SLOW_CHILD_GROUP = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", '''
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2.0), sys.exit(0)))
    print("ready", flush=True)
    time.sleep(60)
    '''], stdout=sys.stdout)
    print(child.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(60)
    """
)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_returns_once_every_process_of_the_group_is_gone():
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD_GROUP],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines = {proc.stdout.readline().strip() for _ in range(2)}  # in either order
    assert "ready" in lines  # the child's SIGTERM handler is set
    child = int((lines - {"ready"}).pop())
    try:
        compare._stop(proc)
        assert proc.returncode is not None
        assert not _running(child), "the group's other process outlived the turn"
    finally:
        if _running(child):
            psutil.Process(child).kill()


def test_an_answer_from_another_process_on_the_port_is_not_readiness(tmp_path):
    # Another process serves /v1/models on the port (a static file, answered 200).
    (tmp_path / "site" / "v1").mkdir(parents=True)
    (tmp_path / "site" / "v1" / "models").write_text('{"data": [{"id": "someone-else"}]}')
    port = free_port()
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
         str(tmp_path / "site"), str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    # The turn's "server" never listens: the port is the other process's.
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    log = tmp_path / "server.log"
    log.write_text("")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and other.poll() is None
                time.sleep(0.1)
        with pytest.raises(RuntimeError, match=f"port {port} was answered by another process"):
            compare._wait_ready(proc, port, log, timeout=20)
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


@pytest.mark.slow
def test_serving_runs_a_fresh_server_every_round(tiny_llama, tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "enginecore.cli", "bench", "compare", str(tiny_llama),
         "--workload", "serving", "--peers", "", "--rounds", "2", "--request-rates", "inf",
         "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
         "--max-model-len", "64", "--output-json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    turns = json.loads(out.read_text())["systems"]["enginecore"]["turns"]
    assert len(turns) == 2
    for turn in turns:
        (point,) = turn["points"]
        assert point["completed"] == 4 and point["failed"] == 0
        assert point["total_output_tokens"] == 16
