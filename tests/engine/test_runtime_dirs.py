"""No socket directory or process outlives a run, whoever is killed.

Real processes, SIGKILL and a private temp dir per test (``TMPDIR``), so every
``enginecore-*`` entry in it belongs to the run under test.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from enginecore import LLM, AsyncLLM, EngineDeadError, SamplingParams
from enginecore.runtime_dirs import OWNER_FILE, _owner_record, make_runtime_dir
from tests.helpers.serve_process import free_port, serve, start_cli

ENGINE_ARGS = dict(dtype="float32", num_blocks_override=256, max_model_len=512, executor="mp")
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture
def private_tmp(monkeypatch) -> pathlib.Path:
    # Short: an IPC socket path must fit in 107 bytes.
    base = tempfile.mkdtemp(prefix="ecrt-")
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield pathlib.Path(base)
    shutil.rmtree(base, ignore_errors=True)


def runtime_entries(base: pathlib.Path) -> list[str]:
    return sorted(p.name for p in base.iterdir() if p.name.startswith("enginecore-"))


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_until_clean(base: pathlib.Path, pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not runtime_entries(base) and not alive(pids):
            return
        time.sleep(0.1)
    pytest.fail(
        f"left behind after {timeout:.0f} s: directories {runtime_entries(base)}, "
        f"processes {alive(pids)}"
    )


def family(pid: int) -> list[int]:
    """The process and every descendant (the engine's workers), by pid."""
    proc = psutil.Process(pid)
    return [pid, *(child.pid for child in proc.children(recursive=True))]


# --- stale directories of dead owners --------------------------------------------------------


def test_a_fresh_start_removes_directories_of_dead_owners_only(private_tmp) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    record = _owner_record(dead.pid)  # taken while it runs, as its own directory would be
    dead.kill()
    dead.wait()
    stale = private_tmp / "enginecore-mp-stale"
    stale.mkdir()
    (stale / OWNER_FILE).write_text(record)
    (stale / "rendezvous").write_text("")
    mine = private_tmp / "enginecore-live"
    mine.mkdir()
    (mine / OWNER_FILE).write_text(_owner_record(os.getpid()))
    unknown = private_tmp / "enginecore-no-owner"
    unknown.mkdir()

    fresh = make_runtime_dir()

    assert not stale.exists()
    assert mine.exists() and unknown.exists() and pathlib.Path(fresh).is_dir()
    assert oct(os.stat(fresh).st_mode & 0o777) == "0o700"


# --- SIGKILL: whoever survives cleans up ------------------------------------------------------


@pytest.mark.parametrize("victim", ["engine", "worker"])
def test_llm_leaves_nothing_when_a_process_is_killed(private_tmp, tiny_llama, victim) -> None:
    llm = LLM(tiny_llama, **ENGINE_ARGS)
    try:
        engine_pid = llm.engine_client.proc.pid
        pids = family(engine_pid)
        assert len(pids) == 2, pids  # the engine and its one worker
        assert len(runtime_entries(private_tmp)) == 2  # frontend's and executor's
        os.kill(pids[0] if victim == "engine" else pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            llm.generate(["a b c"], LONG, use_tqdm=False)
        # While the LLM object still exists: nothing of the dead engine is left.
        wait_until_clean(private_tmp, pids)
    finally:
        llm.shutdown()
    assert runtime_entries(private_tmp) == []


def test_async_llm_leaves_nothing_when_the_engine_is_killed(private_tmp, tiny_llama) -> None:
    async def run() -> list[int]:
        llm = AsyncLLM(tiny_llama, **ENGINE_ARGS)
        try:
            pids = family(llm.ready.pid)
            os.kill(pids[0], signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("a b c", LONG, request_id="r"):
                    pass
            for _ in range(200):
                if not runtime_entries(private_tmp) and not alive(pids):
                    break
                await asyncio.sleep(0.1)
            return pids
        finally:
            llm.shutdown()

    pids = asyncio.run(run())
    wait_until_clean(private_tmp, pids, timeout=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["engine", "server"])
def test_serve_leaves_nothing_when_a_process_is_killed(
    private_tmp, tiny_llama, tmp_path, victim
) -> None:
    log = tmp_path / "server.log"
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    server, _url = serve(
        tiny_llama, log, "--executor", "mp", "--num-blocks-override", "256", env=env
    )
    pids: list[int] = []
    try:
        pids = family(server.pid)
        assert len(pids) == 3, pids  # server, engine, worker
        assert len(runtime_entries(private_tmp)) == 2
        os.kill(pids[1] if victim == "engine" else pids[0], signal.SIGKILL)
        if victim == "engine":  # the server exits non-zero, as an orchestrator expects
            assert server.wait(30) != 0, log.read_text()
        wait_until_clean(private_tmp, pids, timeout=30.0)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_server_killed_while_its_workers_start_leaves_nothing(private_tmp, tiny_llama, tmp_path):
    log = tmp_path / "server.log"
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    server = start_cli(
        ["serve", str(tiny_llama), "--port", str(free_port()), "--executor", "mp"], log, env
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 3 and time.monotonic() < deadline:  # server, engine, worker
            assert server.poll() is None, log.read_text()
            pids = family(server.pid)
            time.sleep(0.05)
        assert len(pids) == 3, log.read_text()
        assert "listening on" not in log.read_text()  # still starting
        server.kill()
        server.wait(10)
        wait_until_clean(private_tmp, pids, timeout=30.0)
    finally:
        if server.poll() is None:
            server.kill()
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)
