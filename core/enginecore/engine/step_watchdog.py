"""The step watchdog of an engine-core process: a step that never ends is reported.

The busy loop runs plugin code in every step (a policy's ``sort_key``, a KV connector's
scheduler half, and with the ``uni`` executor the forward pass itself). One that never
returns would hold the loop while the frontend waits for outputs that never come. Past
``engine.execute_timeout`` (plus a grace that lets the ``mp`` executor's own watchdog,
which names the rank, speak first) this watchdog names the plugin and method found on
the process's threads, hands that to ``on_hung`` (the process tells its frontends the
engine is dead, with that reason) and the process exits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from enginecore.engine.inproc_watchdog import where_stuck
from enginecore.plugins import PluginHost

#: Seconds past ``engine.execute_timeout`` before a step is declared hung here.
STEP_GRACE = 5.0


class StepWatchdog:
    """``started()`` before each step and ``ended()`` after it; a step that runs past
    ``limit + STEP_GRACE`` seconds calls ``on_hung(message)`` once, from its own thread."""

    def __init__(
        self, limit: float, on_hung: Callable[[str], None], host: PluginHost | None = None
    ) -> None:
        self.limit = limit
        self._host = host
        self._on_hung = on_hung
        self._since: float | None = None
        self._loop = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="enginecore-step-watch", daemon=True
        )
        self._thread.start()

    def started(self) -> None:
        self._since = time.monotonic()

    def ended(self) -> None:
        self._since = None

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 4)):
            since = self._since
            if since is None or time.monotonic() - since <= self.limit + STEP_GRACE:
                continue
            others = [t.ident for t in threading.enumerate() if t.ident != self._loop]
            where = where_stuck([self._loop, *others], self._host)
            self._on_hung(
                f"the engine core is stuck: a step took longer than {self.limit:g} s "
                f"(engine.execute_timeout), {where}"
            )
            return

    def close(self) -> None:
        self._stop.set()
