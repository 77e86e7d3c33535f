"""``enginecore bench compare --workload serving``: each turn's server, started and stopped.

A turn's server is stopped with every process of its group (a peer's engine process can
outlive its API server), its readiness is an answer from that server and not from
whatever else holds the port, and the serving rounds run one after the other.
"""

from __future__ import annotations

import http.server
import json
import pathlib
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from enginecore.bench import compare

ROOT = pathlib.Path(__file__).resolve().parents[1]

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


class _AnyModels(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "someone-else"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_from_another_process_on_the_port_is_not_readiness(tmp_path):
    other = http.server.HTTPServer(("127.0.0.1", 0), _AnyModels)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    # The "server" of the turn never listens: the port is the other process's.
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    log = tmp_path / "server.log"
    log.write_text("")
    try:
        with pytest.raises(RuntimeError, match=f"port {port} was answered by another process"):
            compare._wait_ready(proc, port, log, timeout=20)
    finally:
        proc.kill()
        proc.wait()
        other.shutdown()
        other.server_close()


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
