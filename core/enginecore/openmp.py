"""The OpenMP wait policy of the engine's processes: idle threads sleep, not spin.

libgomp (torch's OpenMP runtime, which the CPU kernels share) lets a thread that finished
its share of a parallel region spin before it sleeps (``GOMP_SPINCOUNT``, about 3 ms by
default). On a machine with other work running, that spinning takes the core the
working thread needs, and every barrier waits for a thread that was preempted: a
prefill of many small parallel regions slows several-fold. On a quiet machine the two
policies measured alike (benchmarks/RESULTS.md, "The engine beside other work").

libgomp reads its environment once, when it loads, so the policy goes into the
environment of the processes the engine starts (the engine core, the ``mp`` executor's
workers) and, for an engine in the caller's process, into ``os.environ`` when no OpenMP
runtime is loaded there yet. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``
is kept as it is (``GOMP_SPINCOUNT=300000`` is libgomp's own default).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULTS = {"OMP_WAIT_POLICY": "passive"}
# Shared objects of OpenMP runtimes (GNU, LLVM, Intel) as /proc/self/maps names them.
_RUNTIMES = ("libgomp", "libomp", "libiomp")


def wait_policy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ``: none where the user chose a wait policy."""
    if any(name in environ for name in USER_VARIABLES):
        return {}
    return dict(DEFAULTS)


def child_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a process the engine starts: ``environ`` (default
    ``os.environ``) with the engine's wait policy unless the user set one."""
    base = dict(os.environ if environ is None else environ)
    return {**base, **wait_policy_env(base)}


def openmp_loaded() -> bool:
    """Whether an OpenMP runtime is mapped in this process (it has read its environment)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(runtime in line for line in maps for runtime in _RUNTIMES)
    except OSError:  # not Linux: torch loads its runtime with it
        return "torch" in sys.modules


def apply_in_process() -> bool:
    """Set the wait policy for an engine in this process; true when it is in effect
    (set here, or the user's own). Too late once an OpenMP runtime is loaded (the caller
    imported torch first): then it says so."""
    missing = wait_policy_env(os.environ)
    if not missing:
        return True
    if openmp_loaded():
        logger.info(
            "OpenMP was loaded before the engine started, so its idle threads spin "
            "(libgomp's default) and slow it beside other work; set OMP_WAIT_POLICY=passive "
            "before starting Python, or start the engine before importing torch"
        )
        return False
    os.environ.update(missing)
    return True
