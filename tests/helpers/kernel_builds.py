"""The CPU kernels' C sources compiled for one x86-64 level, or as the engine builds them.

The engine names a build by its level (``-march``) and keys it by source and flags; a
level other than this CPU's is asked for by a later ``-march``, which overrides the
engine's (the compiler keeps the last one). Without ``-march`` changing the engine's own
choice, builds for several levels may run side by side, and land in the engine's kernel
cache: a test module asking for a build another one made loads that file.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

from enginecore_cpu import cpu_kernels, quant_kernels

# The levels a test compares: what the engine builds here, and on x86-64 the AVX2 and
# portable builds too (the code an AVX2-only or an older CPU runs).
LEVELS = [
    "host",
    *(["x86-64-v3", "x86-64"] if platform.machine().lower() in ("x86_64", "amd64") else []),
]


def extra_isa_for(level: str) -> tuple[str, list[str]] | None:
    """``cpu_kernels.build``'s ``extra_isa`` for ``level``: ``host`` is what the engine
    builds here (with VNNI where the CPU has it); this CPU's own level is that without
    VNNI; another level overrides the engine's ``-march``, ``x86-64-v3+avxvnni`` with
    AVX-VNNI (what the engine builds on an AVX2 CPU that has it)."""
    if level == "host":
        return quant_kernels._vnni()
    if level == cpu_kernels.instruction_set():
        return None
    if level == "x86-64-v3+avxvnni":
        return ("as-x86-64-v3-avxvnni", ["-march=x86-64-v3", "-mavxvnni"])
    return (f"as-{level}", [f"-march={level}"])


def build_for(level: str, source: Path, directory: Path | None = None) -> ctypes.CDLL:
    """``source`` compiled for ``level`` (see ``extra_isa_for``), loaded: in the engine's
    kernel cache under the engine's name for it, or in ``directory`` (a source the
    engine does not ship, copied there beside the headers it includes)."""
    stem = source.stem if directory is not None else f"enginecore_{source.stem}"
    path = cpu_kernels.build(directory, source=source, stem=stem, extra_isa=extra_isa_for(level))
    return ctypes.CDLL(str(path))


def cpu_kernel_builds() -> dict[str, cpu_kernels.CpuKernels]:
    """``cpu_kernels.c`` built for each of ``LEVELS``, loaded."""
    return {
        level: cpu_kernels.CpuKernels(
            cpu_kernels.build(
                source=cpu_kernels.SOURCE,
                stem=f"enginecore_{cpu_kernels.SOURCE.stem}",
                extra_isa=extra_isa_for(level),
            )
        )
        for level in LEVELS
    }
