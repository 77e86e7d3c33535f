"""A report, while it happens, of a linear method stuck preparing one layer's weights.

``process_weights_after_loading`` is plugin code that runs once per layer at start-up;
one that never returns would only surface when ``engine.ready_timeout`` runs out, as a
start-up timeout that names nothing. :class:`PreparationWatch` watches from a thread of
its own and, once one layer has taken :data:`REPORT_AFTER` seconds, logs an error naming
the linear method, its plugin and the layer, while start-up is still waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from enginecore.plugin_attribution import attribute_origin

logger = logging.getLogger("enginecore.startup")

#: Seconds one layer's weight preparation may take before it is reported.
REPORT_AFTER = 30.0


class PreparationWatch:
    """``with PreparationWatch(method) as watch:`` then ``watch.started(name)`` before
    each layer; a layer still running after ``report_after`` seconds is logged once."""

    def __init__(self, method: Any, report_after: float = REPORT_AFTER) -> None:
        self.method = method
        self.report_after = report_after
        self._layer: str | None = None
        self._since = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="enginecore-prepare-watch", daemon=True
        )

    def started(self, layer: str) -> None:
        self._layer, self._since = layer, time.monotonic()

    def _watch(self) -> None:
        reported = None
        while not self._done.wait(min(1.0, self.report_after / 4)):
            layer, since = self._layer, self._since
            if layer is None or layer == reported:
                continue
            waited = time.monotonic() - since
            if waited >= self.report_after:
                reported = layer
                cls = type(self.method)
                where = attribute_origin(cls.process_weights_after_loading)
                logger.error(
                    "linear method %s%s has been preparing layer %r for %.0f s "
                    "(process_weights_after_loading has not returned); start-up fails "
                    "at engine.ready_timeout unless it does",
                    cls.__qualname__,
                    f" from {where}" if where else "",
                    layer,
                    waited,
                )

    def __enter__(self) -> PreparationWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
