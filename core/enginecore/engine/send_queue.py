"""Accounting for ZeroMQ sends an asyncio socket could not complete at once.

``zmq.asyncio`` returns a future from ``send_multipart``: done when the message went to
the socket, pending while the socket is at its high-water mark. The clients' request
paths are synchronous (a request is validated and sent in one call), so they hand each
future here instead of awaiting it: the count of pending sends is what the frontend has
queued for an engine that is not keeping up, and the server refuses new requests (503)
while it is above a bound. A send that failed is logged, never left unretrieved.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


class SendQueue:
    """How many sends are still waiting for room in their socket."""

    def __init__(self) -> None:
        self.pending = 0

    def track(self, sent: Any) -> None:
        """Account for what ``send_multipart`` returned (a future on asyncio sockets)."""
        if not isinstance(sent, asyncio.Future) or sent.done():
            if isinstance(sent, asyncio.Future):
                self._log_failure(sent)
            return
        self.pending += 1
        sent.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[Any]) -> None:
        self.pending -= 1
        self._log_failure(future)

    @staticmethod
    def _log_failure(future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.error("a message to the engine core was not sent: %s", future.exception())
