"""An API server's link to an engine core another process started (``enginecore serve
--api-server-count N``): the launcher starts one engine core with one input and one
output address per API server, and each API server binds its pair, names its client
index in every request, and watches the engine by pid instead of owning it.

The launcher passes the link in ``ENGINECORE_ATTACH_ENGINE`` (JSON: ``input``,
``output``, ``engine_pid``, ``client_index``); without it a client starts its own engine.
"""

from __future__ import annotations

import json
import os
from typing import Any

ATTACH_ENV = "ENGINECORE_ATTACH_ENGINE"


class RemoteEngineProcess:
    """The ``Popen`` surface the clients use, for an engine this process did not start:
    alive while its pid runs; stopping it is the launcher's job."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import psutil

        if self.returncode is None:
            try:
                if psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE:
                    self.returncode = -1
            except psutil.NoSuchProcess:
                self.returncode = -1
        return self.returncode

    def terminate(self) -> None:
        """The launcher stops the engine after its API servers."""

    def kill(self) -> None:
        """As :meth:`terminate`."""

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()


def attach_link() -> dict[str, Any] | None:
    """The launcher's link for this API server, or None (start an engine of its own)."""
    text = os.environ.get(ATTACH_ENV)
    if not text:
        return None
    link: dict[str, Any] = json.loads(text)
    return link
