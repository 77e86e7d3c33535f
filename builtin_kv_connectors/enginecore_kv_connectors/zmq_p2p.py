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
(producer, default 14579), ``send_timeout`` (seconds a producer keeps unclaimed blocks,
default 120), ``recv_timeout`` (seconds a consumer waits for the producer, default 30),
``load_failure_policy`` (``"fail"``, the default: the request fails with the error; or
``"recompute"``: the decode instance computes the prompt itself), ``secret`` (a shared
secret both instances are given, or ``$ENGINECORE_KV_SECRET``): the block sockets are
then ZeroMQ CURVE, encrypted and admitting only peers that derived their keys from it.
A ``host`` other than loopback needs one: KV blocks never cross a network unauthenticated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq

from enginecore.config import EngineConfig
from enginecore.engine.wire_auth import (
    CurveKeys,
    authenticator_for,
    keys_from_secret,
    secure_client,
    secure_server,
    stop_authenticator,
)
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

logger = logging.getLogger(__name__)

NAME = "zmq_p2p"
SECRET_ENV = "ENGINECORE_KV_SECRET"
_SERVED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class P2PSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 14579
    send_timeout: float = 120.0
    recv_timeout: float = 30.0
    load_failure_policy: str = "fail"
    secret: str | None = None

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
        return settings


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _curve_keys(settings: P2PSettings) -> CurveKeys | None:
    return keys_from_secret(settings.secret, NAME) if settings.secret else None


class ServeJob(msgspec.Struct, array_like=True):
    """Producer: a finished request's prompt blocks, kept for one decode instance."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


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


class _Get(msgspec.Struct, array_like=True):
    remote_request_id: str
    first_block: int
    keys: list[str]


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

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        return request.sampling_params.kv_transfer_params or {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self._params(request)
        if (
            self.role == "kv_producer"
            or not params.get("do_remote_prefill")
            or request.request_id in self._fetched
        ):
            return 0, False
        remote_tokens = int(params.get("num_tokens", 0))
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
        keys = prefix_keys(request.prompt_token_ids, self.block_size, request.cache_salt)
        self._fetches.append(
            FetchJob(
                req_id=request.request_id,
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                remote_request_id=str(params["remote_request_id"]),
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
            or not self._params(request).get("do_remote_decode")
            or request.status not in _SERVED_STATUSES
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


@dataclass
class _Held:
    job: ServeJob
    deadline: float


class _BlockServer:
    """The producer's ROUTER socket, on its own thread: answers GETs for held blocks."""

    def __init__(
        self,
        worker: ZmqP2PWorker,
        host: str,
        port: int,
        send_timeout: float,
        keys: CurveKeys | None = None,
    ) -> None:
        self.worker = worker
        self.send_timeout = send_timeout
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            authenticator_for(self.context).allow(keys.client_public)
            secure_server(self.socket, keys)
        try:
            self.socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.socket.close()
            self.context.term()
            raise ConfigError(
                f"kv_transfer.extra_config: zmq_p2p cannot listen on {host}:{port} ({exc}); "
                "choose another port"
            ) from None
        self.lock = threading.Lock()
        self.held: dict[str, _Held] = {}
        self.done: set[str] = set()  # served or expired: blocks may be freed
        self.gone: dict[str, None] = {}  # recently served or expired ids (bounded)
        self.waiting: list[tuple[bytes, _Get, float]] = []  # GETs that came before the job
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-zmq-p2p-server", daemon=True)
        self.thread.start()

    def hold(self, job: ServeJob) -> None:
        with self.lock:
            self.held[job.req_id] = _Held(job, time.monotonic() + self.send_timeout)
            self.gone.pop(job.req_id, None)  # a request id reused by a client

    def take_done(self) -> set[str]:
        with self.lock:
            done, self.done = self.done, set()
        return done

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        decoder = msgspec.msgpack.Decoder(_Get)
        while not self._stop.is_set():
            if poller.poll(20):
                identity, _, raw = self.socket.recv_multipart()
                try:
                    get = decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    self._reply(identity, [b"ERR", f"bad request: {exc}".encode()])
                    continue
                self.waiting.append((identity, get, time.monotonic() + self.send_timeout))
            self._serve_waiting()
            self._expire()

    def _serve_waiting(self) -> None:
        still = []
        now = time.monotonic()
        for identity, get, deadline in self.waiting:
            with self.lock:
                held = self.held.get(get.remote_request_id)
            if held is None:
                if get.remote_request_id in self.gone:
                    self._reply(
                        identity, [b"ERR", b"this request's KV was already sent or expired"]
                    )
                elif now < deadline:
                    still.append((identity, get, deadline))  # the job is not registered yet
                else:
                    self._reply(identity, [b"ERR", b"no KV held for this request"])
                continue
            self._reply(identity, self._blocks(held.job, get))
            with self.lock:
                self.held.pop(get.remote_request_id, None)
                self.done.add(get.remote_request_id)
            self._forget(get.remote_request_id)
        self.waiting = still

    def _blocks(self, job: ServeJob, get: _Get) -> list[bytes]:
        end = get.first_block + len(get.keys)
        if (
            get.first_block < 0
            or end > len(job.keys)
            or job.keys[get.first_block : end] != get.keys
        ):
            return [b"ERR", b"the requested blocks do not match the prefill request's prompt"]
        worker = self.worker
        data = gather_blocks(worker.kv_caches, job.block_ids[get.first_block : end])
        return [b"OK"] + [encode_block(worker.layout, block) for block in data]

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for req_id, held in list(self.held.items()):
                if now > held.deadline:
                    logger.warning("zmq_p2p: no decode instance claimed %s: blocks freed", req_id)
                    del self.held[req_id]
                    self.done.add(req_id)
                    self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        self.gone[req_id] = None
        while len(self.gone) > 100_000:
            del self.gone[next(iter(self.gone))]

    def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        self.socket.send_multipart([identity, b"", *frames], copy=False)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.socket.close()
        stop_authenticator(self.context)
        self.context.term()


class ZmqP2PWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.settings = P2PSettings.of(config)
        self.rank = rank
        self.kv_caches: list[torch.Tensor] = []
        self.layout: KVLayout | None = None
        self.server: _BlockServer | None = None
        if config.kv_transfer.role != "kv_consumer":
            s = self.settings
            self.server = _BlockServer(self, s.host, s.port + rank, s.send_timeout, _curve_keys(s))
        self.context = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-zmq-p2p-fetch")
        self._fetches: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._invalid_blocks: set[int] = set()
        self._failures: dict[str, str] = {}
        self._first_block: dict[str, int] = {}  # per fetch: where a recompute would start
        # Measured transfers (consumer): bytes received, seconds from the GET to the last
        # byte (wire) and to the blocks in the cache (total).
        self.transfers = {"fetches": 0, "bytes": 0, "wire_s": 0.0, "total_s": 0.0}

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
        for job in metadata.fetches:
            self._first_block[job.req_id] = job.block_ids[0]
            self._fetches[job.req_id] = self._pool.submit(self._fetch, job)

    def _fetch(self, job: FetchJob) -> None:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        keys = _curve_keys(self.settings)
        secure_client(socket, keys.for_client() if keys is not None else None)
        address = f"tcp://{job.remote_host}:{job.remote_port + self.rank}"
        started = time.perf_counter()
        try:
            socket.connect(address)
            get = _Get(job.remote_request_id, job.first_block, job.keys)
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
        status, blocks = frames[1], frames[2:]
        if status != b"OK":
            raise RuntimeError(f"prefill instance at {address}: {b''.join(blocks).decode()}")
        assert self.layout is not None
        dtype = self.kv_caches[0].dtype
        good: list[torch.Tensor] = []
        for raw in blocks:
            try:
                good.append(decode_block(self.layout, raw, dtype))
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
    def scheduler_side(self, config: EngineConfig) -> ZmqP2PScheduler:
        return ZmqP2PScheduler(config)

    def worker_side(self, config: EngineConfig, rank: int) -> ZmqP2PWorker:
        return ZmqP2PWorker(config, rank)
