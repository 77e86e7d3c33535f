"""A dead local data-parallel replica's runtime directory goes when its death is noticed.

``enginecore serve --data-parallel-size 2`` in a private ``TMPDIR``; replica 1's engine
process is SIGKILLed. The frontend notices (``/health`` names the replica), removes that
replica's socket directory and what its engine left, keeps replica 0's directory, and
serves on with the real ``openai`` client.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import httpx
import openai
import pytest

from enginecore.runtime_dirs import OWNER_FILE
from tests.helpers.serve_process import serve, stop

pytestmark = pytest.mark.slow

ENGINE_TITLE = "EngineCore_DP"  # as ``ps`` shows a replica's engine process


def replica_engines(frontend_pid: int, tmpdir: pathlib.Path) -> dict[int, tuple[int, pathlib.Path]]:
    """replica index -> (engine pid, its socket directory). The engines are the frontend's
    children titled ``EngineCore_DP<index>``; the frontend makes the replicas' socket
    directories (each with its ``input`` socket) one after another in index order, each
    before its engine starts."""
    pids = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().decode().split("\0")[0].strip()
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == frontend_pid and title.startswith(ENGINE_TITLE):
            pids[int(title.removeprefix(ENGINE_TITLE))] = int(entry.name)
    sockets = [d for d in dirs_owned_by(tmpdir, frontend_pid) if (d / "input").exists()]
    sockets.sort(key=lambda d: (d / OWNER_FILE).stat().st_mtime_ns)
    if len(sockets) != len(pids):
        return {}
    return {index: (pid, sockets[index]) for index, pid in pids.items()}


def dirs_owned_by(tmpdir: pathlib.Path, pid: int) -> list[pathlib.Path]:
    owned = []
    for path in tmpdir.glob("enginecore-*"):
        try:
            if int((path / "owner").read_text().split()[0]) == pid:
                owned.append(path)
        except (OSError, ValueError, IndexError):
            continue
    return owned


def test_a_killed_replicas_directory_goes_and_the_server_serves_on(tiny_llama, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    env["TMPDIR"] = str(tmpdir)
    flags = ["--max-model-len", "128", "--num-blocks-override", "64"]
    proc, url = serve(tiny_llama, tmp_path / "server.log", *flags, "--data-parallel-size", "2",
                      env=env)  # fmt: skip
    try:
        engines = replica_engines(proc.pid, tmpdir)
        assert sorted(engines) == [0, 1], engines
        (live_pid, live_dir), (dead_pid, dead_dir) = engines[0], engines[1]
        assert live_dir.is_dir() and dead_dir.is_dir() and live_dir != dead_dir
        assert dirs_owned_by(tmpdir, dead_pid), "the replica's executor has its own directory"

        os.kill(dead_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the replica's death was not noticed"
            time.sleep(0.2)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "replica 1" in health.text

        # Removed when the death is noticed, not at shutdown: a short grace for the
        # engine's workers, which remove its executor directory when they see it gone.
        deadline = time.monotonic() + 10
        while (dead_dir.exists() or dirs_owned_by(tmpdir, dead_pid)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not dead_dir.exists(), "the dead replica's socket directory is left"
        assert dirs_owned_by(tmpdir, dead_pid) == []
        assert live_dir.is_dir() and {"input", "output"} <= {p.name for p in live_dir.iterdir()}
        assert dirs_owned_by(tmpdir, live_pid), "the live replica's executor keeps its own"

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        done = client.completions.create(
            model=model, prompt="hello there", max_tokens=4, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert done.usage.completion_tokens == 4
    finally:
        stop(proc)
    assert list(tmpdir.glob("enginecore-*")) == [], "shutdown leaves nothing behind"
