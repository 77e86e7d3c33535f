"""Verdicts of the packed GEMM's bit-exactness probe, kept on disk per weight shape.

Whether MKL's packed GEMM sums in the same order as ``F.linear`` depends on the shape,
the MKL inside torch and the CPU, never on the weight's values; probing every weight at
each start cost seconds on 2 cores. The verdicts live in one JSON file per (torch
version, CPU flags) under the kernel cache directory; a new torch or another CPU starts
a new file. Writes go through a temporary file and a rename, so concurrent engines never
read a partial file; the last writer's verdicts win, and a lost verdict is only probed
again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import torch

from enginecore_cpu import cpu_kernels

ENV_SWITCH = "ENGINECORE_PROBE_CACHE"
_lock = threading.Lock()
_verdicts: dict[str, bool] | None = None


def path() -> Path:
    """This torch and this CPU's verdict file."""
    parts = [torch.__version__.encode(), cpu_kernels._cpu_signature().encode()]
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    if mkl:  # MKL kept to narrower vectors (ENGINECORE_CPU_ISA's runs) times its GEMMs apart
        parts.append(mkl.encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cpu_kernels.cache_dir() / "packed_gemm_probes" / f"verdicts_{key}.json"


def _key(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _load() -> dict[str, bool]:
    global _verdicts
    if _verdicts is None:
        try:
            data = json.loads(path().read_text())
            _verdicts = {k: bool(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _verdicts = {}
    return _verdicts


def lookup(shape: tuple[int, ...]) -> bool | None:
    """The recorded verdict for this weight shape, or None (probe it)."""
    if cpu_kernels.switched_off(ENV_SWITCH):
        return None
    with _lock:
        return _load().get(_key(shape))


def record(shape: tuple[int, ...], same_bits: bool) -> None:
    """Keep a probe's verdict; a cache directory that cannot be written is skipped."""
    if cpu_kernels.switched_off(ENV_SWITCH):
        return
    with _lock:
        verdicts = _load()
        if verdicts.get(_key(shape)) == same_bits:
            return
        verdicts[_key(shape)] = same_bits
        target = path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=target.parent)
        except OSError:
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(verdicts, f)
            os.replace(tmp, target)
        except OSError:
            pass
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def forget() -> None:
    """Drop the in-memory copy (the next lookup reads the file again)."""
    global _verdicts
    with _lock:
        _verdicts = None
