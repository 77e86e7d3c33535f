"""Process titles as vLLM sets them (``EngineCore_DP0``, ``APIServer_1``,
``Worker_TP0_PP0``), so that ``ps``, ``pgrep -f`` and ``py-spy`` find each process."""

from __future__ import annotations

import contextlib


def set_process_title(name: str) -> None:
    """Title this process ``name``: its command line as ``ps`` shows it (setproctitle)
    and its kernel name (``ps -o comm``, 15 characters)."""
    try:
        import setproctitle
    except ImportError:  # a dependency; without it the kernel name is still set
        with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
        return
    setproctitle.setproctitle(name)
