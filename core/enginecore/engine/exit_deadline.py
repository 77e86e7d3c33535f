"""The engine-core process ends even when a plugin holds its loop.

A stop (the frontend gone, SIGTERM, SIGINT) is a request the busy loop honours between
steps. A plugin stuck in an attention forward, a ``sort_key`` or a KV load never gives
it back, so each stop request also arms a deadline: the drain time plus a grace period.
Past it the process logs where the loop is stuck and exits at once; its workers watch
it and follow. No engine process outlives its frontend, whatever it is stuck in.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)

#: Seconds an orderly stop may take beyond the configured drain (``shutdown_timeout``).
STOP_GRACE = 10.0

_armed = threading.Event()


def where_main_thread_is() -> str:
    """``file:line in function`` of the main thread's innermost frame (for the log)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


def arm_exit_deadline(seconds: float, why: str) -> None:
    """Exit the process with status 1 unless it has ended within ``seconds`` (armed once)."""
    if _armed.is_set():
        return
    _armed.set()

    def expire() -> None:
        time.sleep(seconds)
        logger.error(
            "%s, but the engine did not stop within %.0f s: its loop is stuck at %s "
            "(a plugin that does not return). Exiting now.",
            why,
            seconds,
            where_main_thread_is(),
        )
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=expire, name="enginecore-exit-deadline", daemon=True).start()
