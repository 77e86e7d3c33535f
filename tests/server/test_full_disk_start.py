"""A full disk at start: ``enginecore serve`` with its temporary directory, its cache
directory (compiled kernels, tokenizers) and its trace directory all on a full 64 KiB
tmpfs. The server still starts and serves (Python's ``tempfile`` passes over a temporary
directory it cannot write to; kernels that cannot be cached fall back), a step trace that
cannot be written stops with a warning naming its file while the engine serves on, and
after a normal stop no process and no runtime directory is left.

The tmpfs is mounted in a private user and mount namespace (``unshare -rm``), so the
test needs no root; where the kernel forbids such namespaces it is skipped, saying so.
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

MOUNT_AND_RUN = """
set -e
mount -t tmpfs -o size=64k tmpfs "$FULL"
dd if=/dev/zero of="$FULL/fill" bs=4k count=32 2>/dev/null || true
exec "$@"
"""


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def test_a_full_disk_at_start_neither_stops_the_server_nor_leaves_anything(tiny_llama, tmp_path):
    if not _namespaces_allowed():
        pytest.skip("unshare -rm (user and mount namespaces) is not permitted here")
    full = tmp_path / "full"
    full.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    env.update(FULL=str(full), TMPDIR=str(full), ENGINECORE_CACHE_DIR=str(full / "cache"))
    serve = [sys.executable, "-m", "enginecore.cli", "serve", str(tiny_llama)]
    serve += ["--port", str(port), "--max-model-len", "256", "--dtype", "float32"]
    serve += ["--trace-dir", str(full / "traces"), "--enable-collective-rpc-endpoint"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c", MOUNT_AND_RUN, "sh", *serve],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    tree: list[psutil.Process] = []
    try:
        wait_healthy(url, proc, log_path)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
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
        deadline = time.monotonic() + 10
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
