"""``zmq_p2p``: disaggregated prefill/decode, KV blocks pulled over ZeroMQ.

A *prefill* instance (``role = "kv_producer"``) computes a prompt sent with
``kv_transfer_params = {"do_remote_decode": true}`` (and ``max_tokens = 1``). When the
request finishes, its prompt blocks are kept (``delay_free``) and its output carries
the handle a *decode* instance needs::

    {"do_remote_prefill": true, "remote_host": ..., "remote_port": ...,
     "remote_request_id": ..., "num_tokens": <prompt tokens whose KV is held>}

The decode instance (``role = "kv_consumer"``) gets the same prompt with those
``kv_transfer_params``: the request waits in ``WAITING_FOR_REMOTE_KVS`` while a
background thread asks the prefill worker's ROUTER socket for the blocks (naming them by
their prefix keys, so a different prompt can never receive them), checks each block's
checksum and writes them into its own cache; then only the tail of the prompt is
computed and generation continues. ``enginecore disagg-proxy`` does the routing.

``extra_config``: ``host`` (bind and advertise, default ``127.0.0.1``), ``port``
(producer, default 14579), ``peers`` (consumer: the ``"host:port"`` of each producer it
may fetch from, default ``["<host>:<port>"]``; a request naming any other address is
refused with a 400, so a client never chooses where the decode instance connects),
``send_timeout`` (seconds a producer keeps unclaimed blocks, default 120),
``recv_timeout`` (seconds a consumer waits for the producer, default 30),
``load_failure_policy`` (``"fail"``, the default: the request fails with the error; or
``"recompute"``: the decode instance computes the prompt itself), ``secret`` (a shared
secret both instances are given, or ``$ENGINECORE_KV_SECRET``; on loopback without one,
the user's generated secret, see :mod:`enginecore_kv_connectors.peer_secret`): the block
sockets are always ZeroMQ CURVE, encrypted and admitting only peers that derived their
keys from the secret. A ``host`` other than loopback needs a configured one: KV blocks
never cross a network unauthenticated. ``max_pending_gets`` (default 1024) and
``max_pending_gets_per_peer`` (default 64) bound the requests a producer keeps waiting
for blocks not yet held; beyond them a request is refused at once. A frame that is not a
well-formed request is answered with an error, counted (``rejected_frames``) and logged
once per peer; the server thread never dies of one, and if it dies anyway the engine's
health check fails.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Annotated, Any

import msgspec
import torch
import zmq

from enginecore.config import EngineConfig
from enginecore.engine.wire_auth import CurveKeys, keys_from_secret, secure_client
from enginecore.errors import ConfigError
from enginecore.interfaces import KVConnectorFactory, KVConnectorScheduler, KVConnectorWorker
from enginecore.request import Request, RequestStatus
from enginecore.scheduler_output import SchedulerOutput
from enginecore_kv_connectors.kv_blocks import (
    InvalidBlockError,
    KVLayout,
    decode_block,
    encode_block,
    gather_blocks,
    prefix_keys,
    scatter_blocks,
)
from enginecore_kv_connectors.p2p_block_server import (
    BlockGet,
    BlockServer,
    BlockServerLimits,
    ServeJob,
)
from enginecore_kv_connectors.peer_secret import local_secret

logger = logging.getLogger(__name__)

NAME = "zmq_p2p"
SECRET_ENV = "ENGINECORE_KV_SECRET"
_SERVED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class P2PSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 14579
    peers: list[str] | None = None
    send_timeout: float = 120.0
    recv_timeout: float = 30.0
    load_failure_policy: str = "fail"
    secret: str | None = None
    max_pending_gets: int = 1024
    max_pending_gets_per_peer: int = 64
    max_message_bytes: int = 16 * 1024 * 1024

    @classmethod
    def of(cls, config: EngineConfig) -> P2PSettings:
        try:
            settings = msgspec.convert(config.kv_transfer.extra_config, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"kv_transfer.extra_config (zmq_p2p): {exc}") from None
        if settings.secret is None:
            settings.secret = os.environ.get(SECRET_ENV) or None
        if settings.secret is None and not _loopback(settings.host):
            raise ConfigError(
                f"kv_transfer.extra_config: zmq_p2p on {settings.host} needs a shared secret "
                f"('secret', or ${SECRET_ENV}, the same on both instances): KV blocks do not "
                "cross a network unauthenticated"
            )
        if settings.load_failure_policy not in ("fail", "recompute"):
            raise ConfigError(
                "kv_transfer.extra_config.load_failure_policy must be 'fail' or 'recompute', "
                f"got {settings.load_failure_policy!r}"
            )
        if not 0 < settings.port < 65536:
            raise ConfigError(
                f"kv_transfer.extra_config.port must be 1..65535, got {settings.port}"
            )
        if settings.secret is None:
            settings.secret = local_secret()
        if settings.peers is None:
            settings.peers = [f"{settings.host}:{settings.port}"]
        for peer in settings.peers:
            _split_peer(peer)
        for key in ("max_pending_gets", "max_pending_gets_per_peer", "max_message_bytes"):
            if getattr(settings, key) < 1:
                raise ConfigError(f"kv_transfer.extra_config.{key} must be at least 1")
        return settings

    def peer_allowed(self, host: str, port: int) -> bool:
        return f"{host}:{port}" in (self.peers or ())


def _split_peer(peer: str) -> tuple[str, int]:
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"kv_transfer.extra_config.peers: {peer!r} is not 'host:port' (a producer's "
            "advertised host and port)"
        )
    return host, int(port)


_ID = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_PORT = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_TOKENS = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class P2PTransferParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``kv_transfer_params`` a request may carry: ``{"do_remote_decode": true}`` to
    a producer, or the handle a producer returned to a consumer."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: Annotated[str, msgspec.Meta(max_length=255)] | None = None
    remote_port: _PORT | None = None
    remote_request_id: _ID | None = None
    num_tokens: _TOKENS = 0


def _check_handle(settings: P2PSettings, params: P2PTransferParams) -> None:
    """A consumer's handle: complete, and naming a configured producer."""
    if not params.do_remote_prefill:
        return
    missing = [
        name
        for name in ("remote_host", "remote_port", "remote_request_id")
        if getattr(params, name) is None
    ]
    if missing:
        raise ValueError(f"do_remote_prefill needs {', '.join(missing)} (the producer's handle)")
    assert params.remote_host is not None and params.remote_port is not None
    if not settings.peer_allowed(params.remote_host, params.remote_port):
        raise ValueError(
            f"remote_host:remote_port {params.remote_host}:{params.remote_port} is not a "
            "configured peer of this instance (kv_transfer.extra_config.peers)"
        )


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _curve_keys(settings: P2PSettings) -> CurveKeys | None:
    return keys_from_secret(settings.secret, NAME) if settings.secret else None


class FetchJob(msgspec.Struct, array_like=True):
    """Consumer: pull blocks ``first_block..`` of a remote request into ``block_ids``."""

    req_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    first_block: int
    block_ids: list[int]
    keys: list[str]


class P2PMetadata(msgspec.Struct, kw_only=True):
    fetches: list[FetchJob] = []
    serves: list[ServeJob] = []

    @property
    def load_request_ids(self) -> set[str]:
        return {job.req_id for job in self.fetches}

    @property
    def save_request_ids(self) -> set[str]:
        return set()  # nothing is saved during the forward pass


# --- scheduler side ------------------------------------------------------------------


class ZmqP2PScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig) -> None:
        self.settings = P2PSettings.of(config)
        self.role = config.kv_transfer.role
        self.block_size = config.cache.tokens_per_block
        self._fetches: list[FetchJob] = []
        self._serves: list[ServeJob] = []
        # Requests that already fetched their KV once: if preempted later, they
        # recompute locally (the producer serves each request once).
        self._fetched: set[str] = set()

    def _params(self, request: Request) -> P2PTransferParams:
        """The request's params, checked again here (the frontend checked them already;
        an engine driven without it gets a failed request, never a dead scheduler)."""
        raw = request.sampling_params.kv_transfer_params
        if not raw:
            return P2PTransferParams()
        params = msgspec.convert(raw, P2PTransferParams)
        _check_handle(self.settings, params)
        return params

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.role == "kv_producer" or request.request_id in self._fetched:
            return 0, False
        params = self._params(request)
        if not params.do_remote_prefill:
            return 0, False
        remote_tokens = params.num_tokens
        usable = min(remote_tokens, request.num_prompt_tokens - 1)
        external = usable // self.block_size * self.block_size - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        self._fetched.add(request.request_id)
        params = self._params(request)
        first = request.num_computed_tokens // self.block_size
        last = (request.num_computed_tokens + num_external_tokens) // self.block_size
        assert params.remote_host and params.remote_port and params.remote_request_id
        keys = prefix_keys(request.prompt_token_ids, self.block_size, request.cache_salt)
        self._fetches.append(
            FetchJob(
                req_id=request.request_id,
                remote_host=params.remote_host,
                remote_port=params.remote_port,
                remote_request_id=params.remote_request_id,
                first_block=first,
                block_ids=list(block_ids[first:last]),
                keys=keys[first:last],
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PMetadata:
        fetches, self._fetches = self._fetches, []
        serves, self._serves = self._serves, []
        return P2PMetadata(fetches=fetches, serves=serves)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._fetches = [j for j in self._fetches if j.req_id != request.request_id]
        self._fetched.discard(request.request_id)
        if (
            self.role == "kv_consumer"
            or request.status not in _SERVED_STATUSES
            or not (request.sampling_params.kv_transfer_params or {}).get("do_remote_decode")
        ):
            return False, None
        num_blocks = min(request.num_prompt_tokens // self.block_size, len(block_ids))
        handle = {
            "do_remote_prefill": True,
            "remote_host": self.settings.host,
            "remote_port": self.settings.port,
            "remote_request_id": request.request_id,
            "num_tokens": num_blocks * self.block_size,
        }
        if num_blocks == 0:
            return False, handle  # a prompt shorter than a block: nothing worth sending
        keys = prefix_keys(request.prompt_token_ids, self.block_size, request.cache_salt)
        self._serves.append(
            ServeJob(request.request_id, list(block_ids[:num_blocks]), keys[:num_blocks])
        )
        return True, handle


# --- worker side ---------------------------------------------------------------------


class ZmqP2PWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.settings = P2PSettings.of(config)
        self.rank = rank
        self.kv_caches: list[torch.Tensor] = []
        self.layout: KVLayout | None = None
        self.server: BlockServer | None = None
        if config.kv_transfer.role != "kv_consumer":
            s = self.settings
            limits = BlockServerLimits(
                send_timeout=s.send_timeout,
                max_pending=s.max_pending_gets,
                max_pending_per_peer=s.max_pending_gets_per_peer,
                max_message_bytes=s.max_message_bytes,
            )
            self.server = BlockServer(
                self._read_blocks, s.host, s.port + rank, limits, _curve_keys(s)
            )
        self.context = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-zmq-p2p-fetch")
        self._fetches: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._invalid_blocks: set[int] = set()
        self._failures: dict[str, str] = {}
        self._rejected_reported = 0
        self._first_block: dict[str, int] = {}  # per fetch: where a recompute would start
        # Measured transfers (consumer): bytes received, seconds from the GET to the last
        # byte (wire) and to the blocks in the cache (total).
        self.transfers = {"fetches": 0, "bytes": 0, "wire_s": 0.0, "total_s": 0.0}

    def _read_blocks(self, job: ServeJob, first: int, end: int) -> list[bytes]:
        """The held blocks ``first..end`` of a job, each tagged with its prefix key."""
        assert self.layout is not None
        data = gather_blocks(self.kv_caches, job.block_ids[first:end])
        keys = job.keys[first:end]
        return [
            encode_block(self.layout, block, key) for block, key in zip(data, keys, strict=True)
        ]

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = list(kv_caches.values())
        self.layout = KVLayout.of(self.kv_caches)

    def start_load_kv(self, metadata: P2PMetadata | None) -> None:
        if metadata is None:
            return
        for job in metadata.serves:
            if self.server is None:
                raise RuntimeError("a kv_consumer instance was asked to serve KV blocks")
            self.server.hold(job)
        for fetch in metadata.fetches:
            self._first_block[fetch.req_id] = fetch.block_ids[0]
            self._fetches[fetch.req_id] = self._pool.submit(self._fetch, fetch)

    def _fetch(self, job: FetchJob) -> None:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        keys = _curve_keys(self.settings)
        secure_client(socket, keys.for_client() if keys is not None else None)
        if not self.settings.peer_allowed(job.remote_host, job.remote_port):
            raise RuntimeError(f"{job.remote_host}:{job.remote_port} is not a configured peer")
        address = f"tcp://{job.remote_host}:{job.remote_port + self.rank}"
        started = time.perf_counter()
        try:
            socket.connect(address)
            get = BlockGet(job.remote_request_id, job.first_block, job.keys)
            socket.send_multipart([b"", msgspec.msgpack.encode(get)])
            if not socket.poll(int(self.settings.recv_timeout * 1000)):
                raise TimeoutError(
                    f"no answer from the prefill instance at {address} within "
                    f"{self.settings.recv_timeout:g} s"
                )
            frames = socket.recv_multipart()
            received = time.perf_counter()
        finally:
            socket.close()
        if len(frames) < 2 or frames[0] != b"":
            raise RuntimeError(f"prefill instance at {address}: a malformed answer")
        status, blocks = frames[1], frames[2:]
        if status != b"OK":
            text = b"".join(blocks)[:500].decode(errors="replace")
            raise RuntimeError(f"prefill instance at {address}: {text}")
        if len(blocks) > len(job.block_ids):
            raise RuntimeError(f"prefill instance at {address}: more blocks than asked for")
        assert self.layout is not None
        dtype = self.kv_caches[0].dtype
        good: list[torch.Tensor] = []
        for raw in blocks:
            try:
                # Checked against this request's own prefix key before entering the cache.
                good.append(decode_block(self.layout, raw, dtype, job.keys[len(good)]))
            except InvalidBlockError as exc:
                logger.warning("zmq_p2p: block from %s unusable (%s): recomputed", address, exc)
                with self._lock:
                    self._invalid_blocks.add(job.block_ids[len(good)])
                break
        if len(blocks) < len(job.block_ids) and len(good) == len(blocks):
            with self._lock:  # fewer blocks than asked for: recompute the rest
                self._invalid_blocks.add(job.block_ids[len(good)])
        if good:
            scatter_blocks(self.kv_caches, job.block_ids[: len(good)], torch.stack(good))
        done = time.perf_counter()
        with self._lock:
            self.transfers["fetches"] += 1
            self.transfers["bytes"] += sum(len(raw) for raw in blocks)
            self.transfers["wire_s"] += received - started
            self.transfers["total_s"] += done - started

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # fetches are asynchronous: requests wait until they are reported

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: Any) -> None:
        return None  # the producer serves held blocks on request; nothing to copy per step

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done_recving = set()
        job_blocks = self._first_block
        for req_id, future in list(self._fetches.items()):
            if not future.done():
                continue
            del self._fetches[req_id]
            first_block = job_blocks.pop(req_id, None)
            done_recving.add(req_id)
            exc = future.exception()
            if exc is None:
                continue
            message = f"fetching KV from the prefill instance failed: {exc}"
            if self.settings.load_failure_policy == "recompute" and first_block is not None:
                logger.warning("zmq_p2p: %s (request %s): recomputing", message, req_id)
                with self._lock:  # invalid from the first block on: all of it recomputed
                    self._invalid_blocks.add(first_block)
            else:
                self._failures[req_id] = message
        done_sending = self.server.take_done() if self.server is not None else set()
        return done_sending, done_recving

    def get_num_rejected_messages(self) -> int:
        server = self.server
        if server is None:
            return 0
        stats = server.stats
        total = stats.rejected_frames + stats.refused_gets
        new, self._rejected_reported = total - self._rejected_reported, total
        return new

    def check_health(self) -> None:
        server = self.server
        if server is not None and not server.alive:
            raise RuntimeError(
                f"zmq_p2p: the KV block server on {server.address} stopped "
                f"({server.error or 'unknown reason'}): no decode instance can fetch blocks"
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def get_failures(self) -> dict[str, str]:
        failures, self._failures = self._failures, {}
        return failures

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        self.context.term()


class ZmqP2PConnector(KVConnectorFactory):
    transfer_params_type = P2PTransferParams

    def check_transfer_params(self, config: EngineConfig, params: P2PTransferParams) -> None:
        if params.do_remote_prefill and config.kv_transfer.role == "kv_producer":
            raise ValueError("do_remote_prefill is for a kv_consumer (or kv_both) instance")
        _check_handle(self._settings(config), params)

    _cached_settings: P2PSettings | None = None

    def _settings(self, config: EngineConfig) -> P2PSettings:
        if self._cached_settings is None:
            self._cached_settings = P2PSettings.of(config)
        return self._cached_settings

    def scheduler_side(self, config: EngineConfig) -> ZmqP2PScheduler:
        return ZmqP2PScheduler(config)

    def worker_side(self, config: EngineConfig, rank: int) -> ZmqP2PWorker:
        return ZmqP2PWorker(config, rank)
