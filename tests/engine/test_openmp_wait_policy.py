"""The OpenMP runtime of every engine process sleeps when idle unless the user chose.

Checked in the runtime itself: ``OMP_DISPLAY_ENV=VERBOSE`` makes libgomp print the
settings it resolved when it loads, in each process that loads it (the test process has
torch loaded already, so the blocks come from the processes the engine starts, whose
standard error is this one's; which of them loaded it is read from their memory maps).
``GOMP_SPINCOUNT`` there is how long an idle thread spins: libgomp's own default is
300000, passive is 0. (``/proc/PID/environ`` cannot tell: the process title overwrites
it.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from enginecore import LLM, SamplingParams
from enginecore.openmp import child_env, wait_policy_env

ENGINE_ARGS = dict(dtype="float32", num_blocks_override=64, max_model_len=256)
BLOCK = re.compile(r"OPENMP DISPLAY ENVIRONMENT BEGIN(.*?)OPENMP DISPLAY ENVIRONMENT END", re.S)


def spin_counts(stderr: str) -> list[str]:
    """Each loaded libgomp's resolved ``GOMP_SPINCOUNT``, in the order they loaded."""
    return [re.search(r"GOMP_SPINCOUNT = '(\d+)'", b).group(1) for b in BLOCK.findall(stderr)]


def _openmp_processes(model: object, **kw: object) -> list[str]:
    """Which of the engine core and its workers loaded an OpenMP runtime, by role."""
    with LLM(str(model), **ENGINE_ARGS, **kw) as llm:
        out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
        pids = {"engine core": llm.engine_client.proc.pid}
        for pid in llm.collective_rpc("get_pid"):
            if pid not in pids.values():  # the uni executor's worker is the engine core
                pids[f"worker {pid}"] = pid
        return [role for role, pid in pids.items() if _maps_openmp(pid)]


def _maps_openmp(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libgomp" in maps.read()


@pytest.fixture
def displayed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")


@pytest.mark.usefixtures("displayed")
def test_engine_core_process_sleeps(tiny_llama, capfd) -> None:
    """The ``uni`` executor: the engine core's process runs the model."""
    loaded = _openmp_processes(tiny_llama, executor="uni")
    assert loaded == ["engine core"]
    assert spin_counts(capfd.readouterr().err) == ["0"]


@pytest.mark.usefixtures("displayed")
def test_mp_worker_sleeps(tiny_llama, capfd) -> None:
    """The ``mp`` executor: the worker runs the model (and the engine core, if it loads
    OpenMP at all, sleeps too)."""
    loaded = _openmp_processes(tiny_llama, executor="mp")
    assert any(role.startswith("worker") for role in loaded), loaded
    assert spin_counts(capfd.readouterr().err) == ["0"] * len(loaded)


@pytest.mark.usefixtures("displayed")
def test_users_spin_count_is_kept(tiny_llama, capfd, monkeypatch) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "12345")
    loaded = [p for ex in ("uni", "mp") for p in _openmp_processes(tiny_llama, executor=ex)]
    assert spin_counts(capfd.readouterr().err) == ["12345"] * len(loaded)


def test_users_wait_policy_is_kept() -> None:
    assert wait_policy_env({"OMP_WAIT_POLICY": "active"}) == {}
    assert wait_policy_env({"GOMP_SPINCOUNT": "300000"}) == {}
    assert child_env({"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}
    assert child_env({})["OMP_WAIT_POLICY"] == "passive"


IN_PROCESS = """
import logging
import sys
logging.basicConfig(level=logging.INFO)
if sys.argv[2] == "torch-first":
    import torch
from enginecore import LLM, SamplingParams
with LLM(sys.argv[1], multiprocessing=False, dtype="float32", num_blocks_override=64,
         max_model_len=256) as llm:
    llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0))
"""


def _in_process(model: object, order: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    code = textwrap.dedent(IN_PROCESS)
    done = subprocess.run(
        [sys.executable, "-c", code, str(model), order],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_in_process_engine_sleeps(tiny_llama) -> None:
    """``LLM(multiprocessing=False)``: the policy is set before the engine loads torch."""
    assert spin_counts(_in_process(tiny_llama, "engine-first").stderr) == ["0"]


def test_in_process_after_torch_says_it_spins(tiny_llama) -> None:
    """torch imported first: its runtime has read its environment; the engine says so."""
    done = _in_process(tiny_llama, "torch-first")
    assert spin_counts(done.stderr) == ["300000"]
    assert "OMP_WAIT_POLICY=passive" in done.stderr
