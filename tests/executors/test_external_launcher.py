"""external_launcher under a real ``torchrun`` (CPU, gloo, 2 ranks): every rank schedules
for itself, and the ranks plan identical steps and produce identical outputs."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import msgspec
import pytest

from enginecore.distributed import free_loopback_port
from enginecore.errors import ConfigError

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "torchrun_engine.py"
TORCHRUN = pathlib.Path(sys.executable).parent / "torchrun"


def test_two_torchrun_ranks_schedule_and_generate_identically(tiny_llama, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINECORE_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        str(TORCHRUN),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_loopback_port()),
        str(SCRIPT),
        str(tiny_llama),
        str(tmp_path),
    ]
    # Its own process group, so a hang cannot leave the ranks behind.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = subprocess.CompletedProcess(cmd, proc.returncode, "", stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    rank0, rank1 = (
        msgspec.msgpack.decode((tmp_path / f"rank{r}.msgpack").read_bytes()) for r in (0, 1)
    )
    assert rank0["pid"] != rank1["pid"]
    assert rank0["executor"].startswith("external_launcher")
    assert rank0["client"] == rank1["client"] == "InprocClient"  # no engine process
    assert rank0["world"] == [[0, 2]] and rank1["world"] == [[1, 2]]  # one worker each, TP=2
    steps0, steps1 = rank0["steps"], rank1["steps"]
    assert len(steps0) > 10
    # The run exercised chunked prefill and preemption, where nondeterminism would show.
    assert any(s["preempted_req_ids"] for s in steps0)
    for i, (a, b) in enumerate(zip(steps0, steps1, strict=True)):
        assert a == b, f"step {i} differs between ranks"
    assert rank0["outputs"] == rank1["outputs"]
    assert all(len(tokens) > 0 for _, tokens, _ in rank0["outputs"])


def test_external_launcher_outside_torchrun_is_a_clear_error(tiny_llama, monkeypatch) -> None:
    from enginecore import LLM

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="runs under torchrun"):
        LLM(tiny_llama, executor="external_launcher", tensor_parallel_size=2)
