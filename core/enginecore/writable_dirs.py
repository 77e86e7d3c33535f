"""Start-up check of the directories the engine will write, before any process starts.

Python's ``tempfile`` silently passes over a temporary directory it cannot write to (full,
read-only, missing) and takes the next candidate, so the IPC sockets would land
somewhere the operator did not choose, and a full cache or trace directory would only
surface later as an opaque error. Each directory is probed here by writing a small file:
one that cannot take it fails start-up naming the path, the reason and the setting or
environment variable that moves it.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError

#: Bytes each probe writes (and syncs): a directory that cannot hold this is full.
PROBE_BYTES = 256 * 1024

#: Environment variables Python's ``tempfile`` reads, in its order.
TEMP_VARIABLES = ("TMPDIR", "TEMP", "TMP")


def configured_temp_dir() -> tuple[str, str]:
    """``(directory, what sets it)``: the first temp variable set, else the platform's
    default (what ``tempfile`` would try first)."""
    for name in TEMP_VARIABLES:
        value = os.environ.get(name)
        if value:
            return value, f"the {name} environment variable"
    return "/tmp", "the TMPDIR environment variable (unset: /tmp)"


def cache_dirs() -> list[pathlib.Path]:
    """enginecore's cache roots (tokenizers; compiled CPU kernels, prepared weights)."""
    from enginecore.checkpoints import cache_dir

    roots = [cache_dir()]
    if not os.environ.get("ENGINECORE_CACHE_DIR") and os.environ.get("XDG_CACHE_HOME"):
        roots.append(pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "enginecore")
    return roots


def probe_write(directory: pathlib.Path, *, create: bool) -> str | None:
    """Why ``directory`` cannot take a ``PROBE_BYTES`` file, or None when it can."""
    try:
        if create:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not directory.is_dir():
            return "it does not exist or is not a directory"
        fd, path = tempfile.mkstemp(prefix=".enginecore-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        view = memoryview(bytes(PROBE_BYTES))
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(fd)
        os.unlink(path)
    return None


def check_writable_dirs(config: EngineConfig) -> None:
    """Fail with one line per unusable directory: the temporary directory (IPC sockets,
    rendezvous files), the cache directories and the configured trace directory."""
    problems = []
    temp, temp_setting = configured_temp_dir()
    reason = probe_write(pathlib.Path(temp), create=False)
    if reason:
        problems.append(
            f"temporary directory {temp} (IPC sockets): {reason}; set {temp_setting} "
            "to a writable directory with free space"
        )
    for root in dict.fromkeys(cache_dirs()):
        reason = probe_write(root, create=True)
        if reason:
            problems.append(
                f"cache directory {root} (tokenizers, compiled kernels, prepared weights): "
                f"{reason}; set ENGINECORE_CACHE_DIR to a writable directory with free space"
            )
    trace_dir = config.observability.trace_dir
    if trace_dir:
        path = pathlib.Path(trace_dir).expanduser()
        reason = probe_write(path, create=True)
        if reason:
            problems.append(
                f"trace directory {path}: {reason}; set --trace-dir "
                "(observability.trace_dir) to a writable directory with free space"
            )
    if problems:
        raise ConfigError("cannot write where the engine needs to: " + "; ".join(problems))
