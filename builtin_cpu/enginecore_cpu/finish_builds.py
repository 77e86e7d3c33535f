"""Kernel builds that outlive their process: what a process's background builds had left
when it exited is compiled by a detached process of its own, so the next start finds the
libraries in the cache.

A process's compilers stop with it (``kernel_cache.run_compiler``), and a background
build runs on what CPU the steps leave. A process that exits within seconds of its start
(a one-shot ``enginecore generate``, a script, a short benchmark) would otherwise stop its
builds every time and never find its kernels built: each start would serve its steps the
slower way again. At exit, the builds still running are handed to this module, run as
``python -m enginecore_cpu.finish_builds CACHE MODULE:FUNCTION ...`` in a session of its own
under ``SCHED_IDLE`` (it runs only on a core nothing else wants). Each build waits for
the exiting process's lock on its library, then resumes from the objects that finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import util
from pathlib import Path
from typing import Any

# Only the package's own libraries are handed on: their builds are functions a fresh
# process can import and call with no arguments.
_PACKAGE = f"{__package__}."
_NICENESS = 19  # where SCHED_IDLE is refused
_LOCK = "finishing.lock"

_unfinished: dict[str, int] = {}  # build name: how many of this process's threads run it
_guard = threading.Lock()
_registered = [False]


def build_name(build: Callable[[], Any]) -> str | None:
    """``MODULE:FUNCTION`` of a build another process can run (unwrapping
    ``kernel_cache.idle``), or None for one it cannot."""
    function = build
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    module, qualname = getattr(function, "__module__", ""), getattr(function, "__qualname__", "")
    if not module.startswith(_PACKAGE) or "<" in qualname or "." in qualname:
        return None
    return f"{module}:{qualname}"


@contextlib.contextmanager
def running(build: Callable[[], Any]) -> Iterator[None]:
    """Held while this process runs ``build`` in the background: if the process exits
    first, the build is handed on (see the module's docstring)."""
    name = build_name(build)
    if name is None:
        yield
        return
    with _guard:
        _unfinished[name] = _unfinished.get(name, 0) + 1
        if not _registered[0]:
            _registered[0] = True
            # Run at exit in the main process (atexit) and in a multiprocessing child,
            # which leaves through os._exit after its finalizers, skipping atexit.
            util.Finalize(None, hand_on, exitpriority=0)
    try:
        yield
    finally:
        with _guard:
            _unfinished[name] -= 1
            if not _unfinished[name]:
                del _unfinished[name]


def hand_on() -> subprocess.Popen[bytes] | None:
    """Start the detached process for the builds still running (none: nothing)."""
    with _guard:
        names = sorted(_unfinished)
    if not names:
        return None
    from enginecore_cpu.cpu_kernels import cache_dir  # it imports this module

    try:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, str(cache_dir()), *names],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not stopped with this process's group or terminal
            preexec_fn=_yield_cpu,
        )
    except OSError:  # exiting anyway: the next start builds them
        return None


def _yield_cpu() -> None:
    os.nice(_NICENESS)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(cache: str, names: list[str]) -> int:
    """Run each named build to its end (a failure is left for a start to report), one
    such process at a time on ``cache``: the others wait, before importing the builds
    (and torch with them), at a few megabytes each."""
    Path(cache).mkdir(parents=True, exist_ok=True)
    lock = os.open(Path(cache) / _LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the OS drops it when this process ends
    failed = 0
    for name in names:
        module, _, function = name.partition(":")
        if not module.startswith(_PACKAGE):
            failed += 1
            continue
        try:
            getattr(importlib.import_module(module), function)()
        except (ImportError, AttributeError, OSError, RuntimeError, subprocess.SubprocessError):
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
