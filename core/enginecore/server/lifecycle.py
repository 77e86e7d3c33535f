"""How ``enginecore serve`` ends: a drain on SIGTERM/SIGINT, an exit on engine death.

uvicorn handles the signal: it closes the listening socket (nothing new is accepted) and
waits for open responses. Meanwhile :func:`watch` lets in-flight requests finish for up
to ``engine.shutdown_timeout`` seconds, then aborts what is left in the engine and ends
every open request with an error (a stream gets an error event and ``[DONE]``), so
uvicorn's wait ends and the engine is stopped with nothing running. If the engine dies
instead, the open requests have already failed with the cause; the server then stops
and exits non-zero, as an orchestrator expects of a replica that cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from enginecore.errors import EngineShutdownError

logger = logging.getLogger("enginecore.server")

#: Seconds between checks of the uvicorn server's and the engine's state.
POLL_S = 0.1
#: Seconds uvicorn waits for responses beyond the drain (they end at once after it).
GRACE_MARGIN_S = 5.0


def make_server(uv_config: Any) -> Any:
    """A uvicorn server that exits normally after a drain: uvicorn re-raises the stop
    signal once it has shut down, so the exit status would read "killed by SIGTERM"."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()  # drained: nothing left to re-raise

    return DrainingServer(uv_config)


class Outcome:
    """What ended the server: ``engine_died`` makes the process exit non-zero."""

    engine_died: str | None = None


async def watch(server: Any, engine: Any, drain_timeout: float, outcome: Outcome) -> None:
    """Runs beside uvicorn's ``serve()`` until the server is asked to stop or the engine
    dies; then drains (or gives up on) the in-flight requests."""
    engine.start()  # the output task notices a dead engine even with no traffic
    while not server.should_exit:
        if engine.errored:
            outcome.engine_died = str(engine.dead_error)
            logger.error("the engine died (%s): stopping the server", outcome.engine_died)
            server.should_exit = True
            return
        await asyncio.sleep(POLL_S)
    await drain(engine, drain_timeout)


async def drain(engine: Any, timeout: float) -> None:
    """Let in-flight requests finish for ``timeout`` seconds, then end the rest."""
    open_requests = len(engine.collectors)
    logger.info(
        "shutting down: draining %d in-flight requests (up to %.0f s)", open_requests, timeout
    )
    deadline = time.monotonic() + timeout
    while engine.collectors and time.monotonic() < deadline and not engine.errored:
        await asyncio.sleep(POLL_S)
    if engine.collectors:
        logger.warning("shutting down: aborting %d unfinished requests", len(engine.collectors))
        engine.fail_all_open(
            EngineShutdownError(
                "the server is shutting down: the request was aborted before it finished"
            )
        )
