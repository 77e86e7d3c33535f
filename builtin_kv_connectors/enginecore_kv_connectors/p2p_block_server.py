"""The ``zmq_p2p`` producer's block server: a ROUTER socket on its own thread.

It answers a consumer's GET (a remote request id, the first block and the blocks' prefix
keys) with the blocks a finished prefill request holds. Whatever arrives on the socket
is untrusted: a frame that is not a well-formed GET is answered with an error, counted
(``rejected_frames``) and logged once per peer address, and the thread goes on. GETs that
arrive before their blocks are held wait, in bounded numbers (per connection and in
all), each until its deadline; nothing is rescanned on a timer but what expires.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from enginecore.engine.wire_auth import (
    CurveKeys,
    authenticator_for,
    secure_server,
    stop_authenticator,
)
from enginecore.errors import ConfigError

logger = logging.getLogger(__name__)

#: Peer addresses already logged for a rejected frame (bounded; then logged again).
_MAX_LOGGED_PEERS = 4096
#: Ids remembered as served or expired, to answer a late GET precisely.
_MAX_GONE = 100_000


class ServeJob(msgspec.Struct, array_like=True):
    """Producer: a finished request's prompt blocks, kept for one decode instance."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


class BlockGet(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A consumer's request: blocks ``first_block..`` of ``remote_request_id``."""

    remote_request_id: str
    first_block: int
    keys: list[str]


@dataclass
class _Held:
    job: ServeJob
    deadline: float


@dataclass(eq=False)
class _Waiter:
    identity: bytes
    get: BlockGet
    deadline: float
    answered: bool = False


@dataclass
class BlockServerLimits:
    send_timeout: float
    max_pending: int
    max_pending_per_peer: int
    max_message_bytes: int


@dataclass
class BlockServerStats:
    rejected_frames: int = 0
    refused_gets: int = 0
    logged_peers: set[str] = field(default_factory=set)


#: ``(job, first_block, end) -> encoded blocks``: reads the cache of the rank.
BlockReader = Callable[[ServeJob, int, int], list[bytes]]


class BlockServer:
    def __init__(
        self,
        read_blocks: BlockReader,
        host: str,
        port: int,
        limits: BlockServerLimits,
        keys: CurveKeys | None = None,
    ) -> None:
        self.read_blocks = read_blocks
        self.limits = limits
        self.address = f"{host}:{port}"
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A peer sending a larger message is disconnected by ZeroMQ before it is read.
        self.socket.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        if keys is not None:
            authenticator_for(self.context).allow(keys.client_public)
            secure_server(self.socket, keys)
        try:
            self.socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.socket.close()
            stop_authenticator(self.context)
            self.context.term()
            raise ConfigError(
                f"kv_transfer.extra_config: zmq_p2p cannot listen on {host}:{port} ({exc}); "
                "choose another port"
            ) from None
        self.lock = threading.Lock()
        self.held: dict[str, _Held] = {}  # in deadline order (one timeout for all)
        self.done: set[str] = set()  # served or expired: blocks may be freed
        self.newly_held: list[str] = []
        self.stats = BlockServerStats()
        self.error: str | None = None
        # Owned by the server thread:
        self._gone: dict[str, None] = {}
        self._waiting: dict[str, list[_Waiter]] = {}
        self._queue: collections.deque[_Waiter] = collections.deque()  # deadline order
        self._per_peer: collections.Counter[bytes] = collections.Counter()
        self._decoder = msgspec.msgpack.Decoder(BlockGet)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-zmq-p2p-server", daemon=True)
        self.thread.start()

    # --- called from the worker ----------------------------------------------------------

    def hold(self, job: ServeJob) -> None:
        with self.lock:
            self.held.pop(job.req_id, None)
            self.held[job.req_id] = _Held(job, time.monotonic() + self.limits.send_timeout)
            self.newly_held.append(job.req_id)

    def take_done(self) -> set[str]:
        with self.lock:
            done, self.done = self.done, set()
        return done

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self.socket, zmq.POLLIN)
            while not self._stop.is_set():
                try:
                    if poller.poll(20):
                        self._drain()
                    self._serve_newly_held()
                    self._expire()
                except zmq.ContextTerminated:
                    return
                except Exception:  # one bad message or step never ends the server
                    logger.exception("zmq_p2p block server on %s: unexpected error", self.address)
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if not self._stop.is_set() and self.error is None:
                self.error = "the server thread ended"

    def _drain(self) -> None:
        for _ in range(1024):  # then serve and expire before reading more
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        self._serve_newly_held()  # GETs that waited for these come first
        identity = frames[0].bytes
        if len(frames) != 3 or frames[1].bytes != b"":
            self._reject(frames[0], identity, f"{len(frames) - 1} frame(s), not a GET")
            return
        try:
            get = self._decoder.decode(frames[2].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reject(frames[0], identity, f"not a GET ({exc})")
            return
        req_id = get.remote_request_id
        with self.lock:
            held = self.held.get(req_id)
        if held is not None:
            self._serve(identity, get, held)
        elif req_id in self._gone:
            self._reply(identity, [b"ERR", b"this request's KV was already sent or expired"])
        elif (
            len(self._queue) >= self.limits.max_pending
            or self._per_peer[identity] >= self.limits.max_pending_per_peer
        ):
            self.stats.refused_gets += 1
            self._reply(identity, [b"ERR", b"too many requests waiting for KV blocks: retry"])
        else:  # the job is not registered yet: wait for it, until the deadline
            waiter = _Waiter(identity, get, time.monotonic() + self.limits.send_timeout)
            self._waiting.setdefault(req_id, []).append(waiter)
            self._queue.append(waiter)
            self._per_peer[identity] += 1

    def _reject(self, first: zmq.Frame, identity: bytes, why: str) -> None:
        stats = self.stats
        stats.rejected_frames += 1
        try:
            peer = str(first.get("Peer-Address"))
        except zmq.ZMQError:
            peer = "unknown"
        if peer not in stats.logged_peers:
            if len(stats.logged_peers) >= _MAX_LOGGED_PEERS:
                stats.logged_peers.clear()
            stats.logged_peers.add(peer)
            logger.warning(
                "zmq_p2p block server on %s: malformed message from %s (%s); further ones "
                "from that peer are counted, not logged",
                self.address,
                peer,
                why,
            )
        self._reply(identity, [b"ERR", b"malformed request"])

    def _serve(self, identity: bytes, get: BlockGet, held: _Held) -> None:
        self._reply(identity, self._blocks(held.job, get))
        req_id = get.remote_request_id
        with self.lock:
            self.held.pop(req_id, None)
            self.done.add(req_id)
        self._forget(req_id)

    def _blocks(self, job: ServeJob, get: BlockGet) -> list[bytes]:
        end = get.first_block + len(get.keys)
        if (
            get.first_block < 0
            or end > len(job.keys)
            or job.keys[get.first_block : end] != get.keys
        ):
            return [b"ERR", b"the requested blocks do not match the prefill request's prompt"]
        return [b"OK", *self.read_blocks(job, get.first_block, end)]

    def _serve_newly_held(self) -> None:
        with self.lock:
            if not self.newly_held:
                return
            new, self.newly_held = self.newly_held, []
        for req_id in new:
            waiters = self._waiting.pop(req_id, None)
            if not waiters:
                continue
            with self.lock:
                held = self.held.get(req_id)
            for waiter in waiters:
                self._answered(waiter)
                if held is not None:
                    self._serve(waiter.identity, waiter.get, held)
                    held = None
                else:
                    self._reply(waiter.identity, [b"ERR", b"this request's KV was already sent"])

    def _answered(self, waiter: _Waiter) -> None:
        waiter.answered = True
        self._per_peer[waiter.identity] -= 1
        if self._per_peer[waiter.identity] <= 0:
            del self._per_peer[waiter.identity]

    def _expire(self) -> None:
        now = time.monotonic()
        queue = self._queue
        while queue and (queue[0].answered or queue[0].deadline < now):
            waiter = queue.popleft()
            if waiter.answered:
                continue
            self._answered(waiter)
            req_id = waiter.get.remote_request_id
            waiters = self._waiting.get(req_id)
            if waiters is not None:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiting[req_id]
            self._reply(waiter.identity, [b"ERR", b"no KV held for this request"])
        with self.lock:
            expired = []
            for req_id, held in self.held.items():
                if held.deadline >= now:
                    break
                expired.append(req_id)
            for req_id in expired:
                logger.warning("zmq_p2p: no decode instance claimed %s: blocks freed", req_id)
                del self.held[req_id]
                self.done.add(req_id)
        for req_id in expired:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        gone = self._gone
        gone[req_id] = None
        while len(gone) > _MAX_GONE:
            del gone[next(iter(gone))]

    def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self.socket.send_multipart([identity, b"", *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("zmq_p2p block server on %s: a peer is not reading", self.address)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.socket.close()
        stop_authenticator(self.context)
        self.context.term()
