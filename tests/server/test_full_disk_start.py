"""A full disk, at start and while serving.

At start: ``enginecore serve`` with its temporary directory (IPC sockets), its cache
directory (tokenizers, compiled kernels, prepared weights) or its trace directory on a
full 64 KiB tmpfs stops at once, before any process starts, naming the directory and the
setting that moves it (Python's ``tempfile`` would silently take another temporary
directory; a full cache would fail later, opaquely). While serving: the same directories
on a tmpfs with room at start, filled once the server is up: requests are still served,
a step trace that cannot be written stops with a warning naming its file, and after a
normal stop no process and no runtime directory is left.

The tmpfs is mounted in a private user and mount namespace (``unshare -rm``), so the
test needs no root; where the kernel forbids such namespaces it is skipped, saying so.
The filler runs inside that namespace and waits for a marker file the test writes in a
directory both sides see.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.helpers.serve_process import free_port, stop, wait_healthy

pytestmark = pytest.mark.slow

#: Mount a tmpfs of $SIZE on $FULL; fill it now ($MARK empty) or, once $MARK exists,
#: keep it full (space a failed write frees is taken again) while the server ($$) lives.
MOUNT_AND_RUN = """
set -e
mount -t tmpfs -o size=$SIZE tmpfs "$FULL"
fill() { dd if=/dev/zero of="$FULL/fill-$1" bs=1k 2>/dev/null || true; }
if [ -z "$MARK" ]; then fill 0; else
  (while [ ! -e "$MARK" ]; do sleep 0.1; done; i=0
   while kill -0 $$ 2>/dev/null; do fill $i; i=$((i + 1)); sleep 0.1; done) &
fi
exec "$@"
"""


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def _serve_on_tmpfs(tiny_llama, tmp_path, size: str, mark: str, **placed: str):
    """``enginecore serve`` in a namespace with a tmpfs at ``tmp_path/full``; each of
    ``tmp``, ``cache``, ``traces`` placed on it when ``placed`` names it "full"."""
    if not _namespaces_allowed():
        pytest.skip("unshare -rm (user and mount namespaces) is not permitted here")
    full = tmp_path / "full"
    full.mkdir()
    (tmp_path / "ok").mkdir()
    where = {k: (full if placed.get(k) == "full" else tmp_path / "ok") for k in placed}
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    env.update(FULL=str(full), SIZE=size, MARK=mark)
    env.update(TMPDIR=str(where["tmp"]), ENGINECORE_CACHE_DIR=str(where["cache"] / "cache"))
    serve = [sys.executable, "-m", "enginecore.cli", "serve", str(tiny_llama)]
    serve += ["--port", str(port), "--max-model-len", "256", "--dtype", "float32"]
    serve += ["--trace-dir", str(where["traces"] / "traces"), "--enable-collective-rpc-endpoint"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c", MOUNT_AND_RUN, "sh", *serve],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return proc, f"http://127.0.0.1:{port}", log_path, full


@pytest.mark.parametrize(
    ("on_full", "setting"),
    [("tmp", "TMPDIR"), ("cache", "ENGINECORE_CACHE_DIR"), ("traces", "--trace-dir")],
)
def test_a_full_directory_at_start_fails_at_once_naming_it(
    tiny_llama, tmp_path, on_full, setting
) -> None:
    placed = {"tmp": "ok", "cache": "ok", "traces": "ok", on_full: "full"}
    proc, _url, log_path, full = _serve_on_tmpfs(tiny_llama, tmp_path, "64k", "", **placed)
    try:
        status = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert status != 0, log
    (line,) = [x for x in log.splitlines() if "cannot write where the engine needs to" in x]
    assert str(full) in line and setting in line and "No space left" in line, log
    assert "Traceback" not in log, log
    assert "engine ready" not in log, "the engine started before the check"


def test_a_disk_filled_while_serving_neither_stops_the_server_nor_leaves_anything(
    tiny_llama, tmp_path
) -> None:
    mark = tmp_path / "fill-now"
    proc, url, log_path, _full = _serve_on_tmpfs(
        tiny_llama, tmp_path, "16m", str(mark), tmp="full", cache="full", traces="full"
    )
    tree: list[psutil.Process] = []
    try:
        wait_healthy(url, proc, log_path)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        mark.touch()
        time.sleep(2)  # the filler polls the marker every 0.1 s, then fills 16 MiB
        answer = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        # A trace file can be created on a full disk (an inode), not filled: the trace
        # stops with a warning naming it, the steps it would have traced run on.
        trace = httpx.post(
            f"{url}/collective_rpc", json={"method": "trace_next_steps", "args": [4]}, timeout=60
        )
        assert trace.status_code == 200, trace.text
        (trace_path,) = trace.json()["results"]
        for _ in range(2):
            answer = httpx.post(
                f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
            )
            assert answer.status_code == 200, answer.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        deadline = time.monotonic() + 90  # the steps after the trace call may be slow
        while "cannot be written" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        warning = next(
            (line for line in log_path.read_text().splitlines() if "cannot be written" in line),
            "",
        )
        assert trace_path in warning and "No space left" in warning, log_path.read_text()
    finally:
        stop(proc)
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    # The tmpfs went with the namespace; nothing fell back into the real temp directory
    # under this server's pids either.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _runtime_dirs_of(tree):
        time.sleep(0.2)
    assert not _runtime_dirs_of(tree), _runtime_dirs_of(tree)


def _runtime_dirs_of(tree: list[psutil.Process]) -> list[str]:
    """``enginecore-*`` runtime directories in the default temp dir owned by ``tree``."""
    import tempfile

    from enginecore.runtime_dirs import OWNER_FILE, PREFIX

    pids = {p.pid for p in tree}
    found = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(PREFIX):
            continue
        try:
            with open(os.path.join(root, name, OWNER_FILE)) as f:
                owner = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if owner in pids:
            found.append(name)
    return found
