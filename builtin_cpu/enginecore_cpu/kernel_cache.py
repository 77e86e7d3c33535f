"""The kernel cache's files while they are made: each process compiles into a scratch
folder of its own and renames every finished object and library into the cache, so a
reader never sees a partial file and a build cut short keeps the objects it finished.

While a process lives it holds a lock on its folder's ``.lock`` file; a later process
that can take that lock knows the owner is gone (exited, or killed mid-build) and removes
its folder, under the cache's own lock. A compiler started here is asked to stop when
its process dies (Linux), and one that outlives it finds its output folder removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import heapq
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

_Result = TypeVar("_Result")

SCRATCH = ".building"
# Scratch files the cache's earlier layout made beside the libraries (``tmp*.so`` and
# ``tmp*`` folders); removed once older than any build takes.
_LEGACY_AGE_S = 15 * 60

_workspaces: dict[Path, Path] = {}
_held: list[int] = []  # the lock files' descriptors, open for the process's life
_guard = threading.Lock()


def workspace(cache: Path) -> Path:
    """This process's scratch folder in ``cache`` (made on first use, after removing
    the folders of processes that are gone)."""
    with _guard:
        folder = _workspaces.get(cache)
        if folder is None or not folder.is_dir():
            folder = _workspaces[cache] = _claim(cache)
        return folder


def publish(cache: Path, target: Path, make: Callable[[str], None]) -> None:
    """Run ``make`` on a fresh path in this process's scratch folder and rename what it
    wrote to ``target`` (the rename is atomic: concurrent readers see all or nothing)."""
    fd, scratch = tempfile.mkstemp(suffix=target.suffix, dir=workspace(cache))
    os.close(fd)
    try:
        make(scratch)
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


@contextmanager
def building(target: Path) -> Iterator[None]:
    """Held while this process builds ``target`` (a lock file beside it): another
    process starting on the same cache waits for that build instead of compiling the
    library again. The OS drops the lock when its holder dies."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.with_name(f"{target.name}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def compile_slots() -> int:
    """How many compilers run at once: half the cores this process may use, at least
    one; a first start loads the weights on the others."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


class Slots:
    """Compiler slots handed out by priority (lowest first, then first come): a library
    asked for first has its objects and its link compiled before a later one's, so
    that what a load needs first lands first instead of after everything queued."""

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiting: list[tuple[int, int]] = []  # heap of (priority, arrival)
        self._arrivals = itertools.count()
        self._changed = threading.Condition()
        self._urgent: set[int] = set()

    def urgent(self, priority: int) -> bool:
        with self._changed:
            return priority in self._urgent

    def hurry(self, priority: int) -> None:
        """The builds of this priority go at once, beyond the slots' count: a thread
        waits for their library (its core is free meanwhile)."""
        with self._changed:
            self._urgent.add(priority)
            self._changed.notify_all()

    @contextmanager
    def held(self, priority: int) -> Iterator[None]:
        with self._changed:
            ticket = (priority, next(self._arrivals))
            heapq.heappush(self._waiting, ticket)
            while not (priority in self._urgent or (self._free > 0 and self._waiting[0] == ticket)):
                self._changed.wait()
            self._waiting.remove(ticket)
            heapq.heapify(self._waiting)
            self._free -= 1
            self._changed.notify_all()  # the next in line may take another free slot
        try:
            yield
        finally:
            with self._changed:
                self._free += 1
                self._changed.notify_all()


_slots = Slots(compile_slots())
_priorities: dict[Path, int] = {}
_requests = itertools.count()


_asked = threading.local()  # .rank: this thread's place, given before it started


# Ranks from here on are idle builds: nothing waits for them (the fused decode step's,
# the layers serving meanwhile); they queue after every other build and their compilers
# run under SCHED_IDLE, on what CPU the engine leaves: under a load that never leaves a
# core idle the library waits, and the layers keep serving.
IDLE = 1 << 40
_IDLE_NICENESS = 10


def ranks(count: int, idle: bool = False) -> list[int]:
    """Places in the compilers' queue for ``count`` builds about to start on threads of
    their own, in this order (each thread passes its own to ``asking_as``)."""
    with _guard:
        return [next(_requests) + (IDLE if idle else 0) for _ in range(count)]


def idle(build: Callable[[], _Result]) -> Callable[[], _Result]:
    """``build`` as an idle build: queued after all others, its compilers under
    ``SCHED_IDLE`` (for a library nothing waits for; a build already queued keeps its
    place)."""

    @functools.wraps(build)  # its name: a build handed on at exit runs the build itself
    def run() -> _Result:
        asking_as(ranks(1, idle=True)[0])
        return build()

    return run


def hurry(library: Path) -> None:
    """A thread waits for ``library``: its compilers, queued or to come, start at once
    (beside the slots' count), ahead of the builds that nothing waits for, at the
    niceness they started with (where one was made to yield, see ``serving_started``,
    it is given back where the OS allows)."""
    rank = priority(library)
    _slots.hurry(rank)
    with _guard:
        groups = list(_running.get(rank, ()))
    for group in groups:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, group, 0)


# The compilers running, by their build's rank: their process groups.
_running: dict[int, set[int]] = {}
_serving = [False]


def serving_started() -> None:
    """The engine serves steps (called before each): from now on a compiler nothing
    waits for (a library the steps are served without until it lands) runs at the
    lowest niceness, and those running are reniced so. At the default niceness it held
    a core that a step's OpenMP threads wait for at every parallel region's barrier:
    each step took seconds while it compiled."""
    if _serving[0]:
        return
    with _guard:
        _serving[0] = True
        groups = [(rank, g) for rank, gs in _running.items() for g in gs]
    for rank, group in groups:
        if not _slots.urgent(rank):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PGRP, group, _YIELDING_NICENESS)


def _yields(priority: int) -> bool:
    return _serving[0] and not _slots.urgent(priority)


def in_background() -> bool:
    """Whether this thread compiles for a background build (``asking_as`` gave it a rank)."""
    return getattr(_asked, "rank", None) is not None


def asking_as(rank: int) -> None:
    """The builds this thread asks for take ``rank`` (from ``ranks``)."""
    _asked.rank = rank


def priority(library: Path) -> int:
    """The library's place in the compilers' queue: the order it was first asked for
    (the rank its thread was given, where it was given one)."""
    with _guard:
        rank = getattr(_asked, "rank", None)
        return _priorities.setdefault(library, next(_requests) if rank is None else rank)


def run_compiler(command: list[str], priority: int = 0) -> None:
    """Run one compiler command when a slot is free (by ``priority``); it stops with
    this process, the compiler's own children included. Raises ``RuntimeError`` with the
    compiler's output on failure."""
    with _slots.held(priority):
        child = (
            _idle_child if priority >= IDLE else _yielding_child if _yields(priority) else _child
        )
        process = subprocess.Popen(
            ["sh", "-c", _GROUP_STOPS_WITH_SHELL, "sh", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=child,
        )
        with _guard:
            _running.setdefault(priority, set()).add(process.pid)  # its process group
        try:
            _, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        finally:
            with _guard:
                _running[priority].discard(process.pid)
    if process.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {stderr.strip()[-2000:]}")


# The compiler runs under a shell that leads its own process group. The shell is told
# when this process dies (parent-death signal) and then stops the whole group: the gcc
# driver alone would stop, leaving ``cc1`` compiling, orphaned, for every engine that
# exits or is killed mid-build.
_GROUP_STOPS_WITH_SHELL = 'trap "trap - TERM; kill -TERM -$$" TERM; "$@" & wait $!'


def in_parallel(calls: list[Callable[[], _Result]]) -> list[_Result]:
    """Each call's result, the calls run side by side on daemon threads (a process may
    exit while they run: nothing joins them at exit); the first error is raised."""
    results: list[_Result | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(i,), daemon=True, name="enginecore-cc")
        for i in range(len(calls))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def _claim(cache: Path) -> Path:
    building = cache / SCRATCH
    building.mkdir(parents=True, exist_ok=True)
    with _cache_lock(cache):
        _remove_stale(cache, building)
        name = f"{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(building / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held.append(fd)
        (building / name).mkdir()
    return building / name


@contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    fd = os.open(cache / "build.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_stale(cache: Path, building: Path) -> None:
    for lock in building.glob("*.lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process is alive (this one included)
        else:
            shutil.rmtree(building / lock.stem, ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    for folder in building.iterdir():
        if folder.is_dir() and not folder.with_name(f"{folder.name}.lock").exists():
            shutil.rmtree(folder, ignore_errors=True)
    now = time.time()
    for left in cache.glob("tmp*"):
        try:
            if now - left.stat().st_mtime < _LEGACY_AGE_S:
                continue
            if left.is_dir():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink()
        except OSError:
            continue


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _find_prctl()
_PR_SET_PDEATHSIG = 1


def _child() -> None:
    # In the child between fork and exec: a process group of its own, and SIGTERM when
    # this process dies, which the shell passes to the group (gcc removes its temporaries).
    os.setpgid(0, 0)
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


_YIELDING_NICENESS = 19


def _yielding_child() -> None:
    _child()
    os.nice(_YIELDING_NICENESS)


def _idle_child() -> None:
    _child()
    os.nice(_IDLE_NICENESS)  # where SCHED_IDLE is refused, at least this
    # SCHED_IDLE: the compiler runs only on a core nothing else wants. Niced alone it
    # still takes time slices from the engine's threads, and each parallel region of a
    # step waits at its barrier for the thread whose core the compiler holds.
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
