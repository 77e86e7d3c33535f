"""How a test finds the engine's processes: by the module a process was started with
(its command line until it titles itself) or by its title (``EngineCore_DP0``,
``Worker_TP0_PP0``, ``APIServer_0``) once it has."""

from __future__ import annotations

import psutil

#: process kind -> (a word of its start-up command line, the prefix of its title)
KINDS = {
    "engine": ("core_proc", "EngineCore_DP"),
    "worker": ("mp_worker", "Worker_TP"),
}


def is_kind(process: psutil.Process, kind: str) -> bool:
    """Whether ``process`` is an engine core (``kind="engine"``) or a worker."""
    marker, title = KINDS[kind]
    command = " ".join(process.cmdline())
    return marker in command or command.startswith(title)
