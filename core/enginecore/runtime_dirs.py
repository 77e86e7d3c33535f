"""Owner-only temporary directories for IPC sockets and rendezvous files.

Each directory (``$TMPDIR/enginecore-*``) records the process that made it: its pid, its
start time (so a reused pid is not mistaken for the owner) and its pid namespace (so a
process in another container sharing the temp dir is never judged dead). Whoever
survives a death removes what the dead process left: the frontend when the engine dies,
the engine when the frontend dies, a worker when the engine dies, and every fresh start
sweeps the directories of owners that are gone. Cache directories (compiled kernels) are
not runtime directories and are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

PREFIX = "enginecore-"
OWNER_FILE = "owner"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "-"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot; None when it is gone or a
    zombie (dead, not yet reaped), or "-" where /proc does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        if not os.path.isdir("/proc/self"):
            return "-" if _pid_exists(pid) else None
        return None
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_record(pid: int) -> str:
    return f"{pid} {_start_time(pid) or '-'} {_pid_namespace()}\n"


def make_runtime_dir(kind: str = "") -> str:
    """A fresh 0700 directory ``enginecore-KIND...`` owned by this process, after
    removing those of owners that are gone."""
    remove_stale_dirs()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}")
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(_owner_record(os.getpid()))
    return path


def _read_owner(path: str) -> tuple[int, str, str] | None:
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            pid, start, namespace = f.read().split()
        return int(pid), start, namespace
    except (OSError, ValueError):
        return None  # not ours, or still being created: leave it


def _owner_is_gone(owner: tuple[int, str, str]) -> bool:
    pid, start, namespace = owner
    if namespace != _pid_namespace():
        return False  # another pid namespace: its pids mean nothing here
    now = _start_time(pid)
    return now is None or (start != "-" and now != "-" and now != start)


def _runtime_dirs() -> list[tuple[str, tuple[int, str, str]]]:
    uid = os.getuid()
    found = []
    with contextlib.suppress(OSError), os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            if not entry.name.startswith(PREFIX):
                continue
            try:
                if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                    continue
            except OSError:
                continue
            owner = _read_owner(entry.path)
            if owner is not None:
                found.append((entry.path, owner))
    return found


def remove_dirs_of(pid: int) -> int:
    """Remove the runtime directories of process ``pid`` once it is gone; how many."""
    removed = 0
    for path, owner in _runtime_dirs():
        if owner[0] == pid and _owner_is_gone(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def remove_stale_dirs() -> int:
    """Remove every runtime directory whose owner is gone; how many."""
    removed = 0
    for path, owner in _runtime_dirs():
        if _owner_is_gone(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
