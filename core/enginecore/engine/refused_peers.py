"""Counts and logs the connection attempts the frontend's CURVE sockets refuse.

A data-parallel replica on another node reaches the frontend over TCP (see
:mod:`enginecore.engine.wire_auth`); a peer without the replica's keys is refused during
the ZeroMQ handshake, before any frame is read. This watcher reads the sockets' monitor
events on a thread of its own: every failed handshake (bad bytes, a wrong server key, a
client key the ZAP handler refused) adds one to
``enginecore:data_parallel_refused_connections_total`` and is logged, the first at once
and then at most once a minute with the count since, so a flood cannot fill the log.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

#: A refused peer, by the reason ZeroMQ gives.
REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not the ZeroMQ/CURVE protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key refused",
}
LOG_INTERVAL_S = 60.0
POLL_MS = 100

_counter: Any = None
_counter_lock = threading.Lock()


def _refused_counter() -> Any:
    """The Prometheus counter (one per process, in the registry ``/metrics`` serves)."""
    global _counter
    with _counter_lock:
        if _counter is None:
            from prometheus_client import Counter

            _counter = Counter(
                "enginecore:data_parallel_refused_connections",
                "Connection attempts the frontend's data-parallel sockets refused "
                "(failed handshake or unknown key)",
            )
        return _counter


class RefusedPeers:
    def __init__(self) -> None:
        self.total = 0
        self._new: queue.Queue[zmq.Socket[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._since_log = 0
        self._next_log = 0.0
        self._counter = _refused_counter()
        self._thread = threading.Thread(
            target=self._run, name="enginecore-refused-peers", daemon=True
        )
        self._thread.start()

    def watch(self, socket: zmq.Socket[Any]) -> None:
        """Watch ``socket``'s handshakes (before it binds or right after). The monitor end
        is a plain socket whatever ``socket`` is (asyncio included): this thread reads it."""
        address = f"inproc://enginecore-refused-peers-{id(self)}-{id(socket)}"
        socket.monitor(address, sum(REFUSALS) | zmq.EVENT_MONITOR_STOPPED)
        monitor: zmq.Socket[bytes] = socket.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        monitor.connect(address)
        self._new.put(monitor)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Before the context terminates: every monitor end closes."""
        self._stop.set()
        self._thread.join(5)
        while not self._new.empty():  # handed over after the thread's last look
            self._new.get_nowait().close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        monitors: list[zmq.Socket[bytes]] = []
        try:
            while not self._stop.is_set():
                while not self._new.empty():
                    monitor = self._new.get_nowait()
                    monitors.append(monitor)
                    poller.register(monitor, zmq.POLLIN)
                for monitor, _ in poller.poll(POLL_MS):
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # its socket closed
                        poller.unregister(monitor)
                        monitors.remove(monitor)
                        monitor.close(0)
                        continue
                    reason = REFUSALS.get(event["event"])
                    if reason is not None:
                        endpoint = event.get("endpoint", b"")
                        self._refused(bytes(endpoint).decode(errors="replace"), reason)
        finally:
            for monitor in monitors:
                monitor.close(0)

    def _refused(self, endpoint: str, reason: str) -> None:
        self.total += 1
        self._counter.inc()
        self._since_log += 1
        now = time.monotonic()
        if now < self._next_log:
            return
        if self.total == 1:
            logger.warning(
                "refused a connection to the data-parallel socket %s (%s); further "
                "refusals are counted in enginecore:data_parallel_refused_connections_total "
                "and logged at most once a minute",
                endpoint,
                reason,
            )
        else:
            logger.warning(
                "refused %d connection attempt(s) to the data-parallel sockets since the "
                "last report (latest: %s, %s; %d in all)",
                self._since_log,
                endpoint,
                reason,
                self.total,
            )
        self._since_log = 0
        self._next_log = now + LOG_INTERVAL_S
