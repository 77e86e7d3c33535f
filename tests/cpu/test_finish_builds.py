"""A background kernel build still running when its process exits is finished by a
detached process (``enginecore_cpu.finish_builds``), so that the next start finds the
library built. Before, the compilers stopped with the process: a process that exits
within seconds of its start (a one-shot command, a script) restarted and lost its builds
at every run and never served its steps with them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from enginecore_cpu import cpu_kernels, decode_step, finish_builds, kernel_cache, quant_gemm

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="no C compiler: kernels unavailable"
)

# Starts the many-row kernel's build in the background and exits at once, mid-build.
_EXITS_MID_BUILD = """\
from enginecore_cpu import cpu_kernels, quant_gemm
cpu_kernels.build_in_background(quant_gemm.build)
import time
time.sleep(0.3)
"""


def _finishers(cache: Path) -> list[int]:
    """Pids of the finishing processes working on ``cache``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if finish_builds.__name__.encode() in args and str(cache).encode() in args:
            pids.append(int(proc.name))
    return pids


def test_only_the_packages_own_builds_are_handed_on():
    def local_build() -> Path:
        return Path()

    assert finish_builds.build_name(quant_gemm.build) == "enginecore_cpu.quant_gemm:build"
    idle_build = kernel_cache.idle(decode_step.build)
    assert finish_builds.build_name(idle_build) == "enginecore_cpu.decode_step:build"
    assert finish_builds.build_name(local_build) is None


@pytest.mark.slow
def test_a_build_running_at_exit_lands_after_its_process(tmp_path):
    env = {**os.environ, "ENGINECORE_CACHE_DIR": str(tmp_path)}
    child = subprocess.run(
        [sys.executable, "-c", _EXITS_MID_BUILD], env=env, timeout=120, capture_output=True
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    library = quant_gemm.build(directory=tmp_path / "cpu_kernels", only_path=True)
    deadline = time.monotonic() + 180
    while not library.exists():
        assert time.monotonic() < deadline, "the build left running at exit never landed"
        time.sleep(0.2)
    assert ctypes.CDLL(str(library)).ecg_gemm  # a whole library, not a partial one
    deadline = time.monotonic() + 60
    while _finishers(tmp_path):  # and the finishing process goes once it is done
        assert time.monotonic() < deadline, "the finishing process did not end"
        time.sleep(0.2)
