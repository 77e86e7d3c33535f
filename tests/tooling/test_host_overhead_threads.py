"""``benchmarks/host_overhead.py`` measures the engine with the threads the engine picks
(a thread per core for an offline ``LLM``), not a count of its own; ``--threads`` pins
them, and each run reports the count it ran with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.script_module import ROOT, load_script


def test_loading_the_benchmark_leaves_the_engines_threads_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    load_script("benchmarks/host_overhead.py")
    assert "OMP_NUM_THREADS" not in os.environ


def one_run(*flags: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    script = ROOT / "benchmarks" / "host_overhead.py"
    cmd = [sys.executable, str(script), "--sizes", "2", "--modes", "sync", "--steps", "8"]
    out = subprocess.run(
        [*cmd, "--json", *flags], env=env, check=True, capture_output=True, text=True, timeout=300
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one thread either way")
def test_a_run_takes_the_engines_threads_unless_pinned():
    assert one_run()["threads"] == len(os.sched_getaffinity(0))
    assert one_run("--threads", "1")["threads"] == 1
