"""Clients for data parallelism: N engine-core replicas behind one frontend.

Each replica is a whole engine core (scheduler, KV cache, executor with its own TP x PP
workers) in its own process, started locally (``data_parallel_backend = "mp"``, IPC
sockets) or on a Ray cluster (``"ray"``, see :mod:`enginecore.engine.dp_ray`). Every
replica has its own input and output socket; the client

- picks the replica of each new request with the :class:`DPCoordinator` (or takes the
  request's ``data_parallel_rank``) and remembers it, so aborts go to the owner;
- merges every replica's outputs into one stream (each ``EngineCoreOutputs`` carries its
  ``engine_index``; the stat loggers record per engine);
- fans utility calls (``collective_rpc``, ``sleep``, ``reset_prefix_cache``, pause and
  resume, ...) out to every live replica and combines the answers
  (:func:`combine_utility_results`);
- watches each replica: when one dies, only the requests it owned fail (an
  ``EngineCoreOutputs`` with ``engine_dead`` set and their ids in
  ``finished_requests``), and the frontend keeps serving on the others (degraded mode).
  Requests that name the dead rank are refused with ``EngineDeadError``. Only when every
  replica is dead is the client itself dead;
- with ``data_parallel_failover = "retry"``, resubmits once to a live replica each lost
  request that had produced no output yet (the client has streamed nothing of it, so
  nothing is duplicated; outputs a dead replica sent but the client had not read are
  dropped); a request with output, a second loss, or one pinned to the dead rank fails;
- on Ray, restarts a dead replica: a fresh placement group for it waits until the cluster
  has room (its node, or another, comes back), and the new engine core rejoins load
  balancing and utility fan-out under the same index.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from enginecore.config import EngineConfig
from enginecore.engine.client import EngineCoreClient
from enginecore.engine.dp_coordinator import DPCoordinator
from enginecore.engine.mp_client import (
    LIVENESS_POLL_MS,
    _EngineProcess,
    _resolve,
    take_output,
    take_output_async,
)
from enginecore.engine.send_queue import SendQueue
from enginecore.engine.wire_auth import authenticator_problem, stop_authenticator
from enginecore.errors import EngineCoreError, EngineDeadError
from enginecore.protocol import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from enginecore.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)


def combine_utility_results(method: str, results: list[Any]) -> Any:
    """One answer from every live replica's answer to a fanned-out utility call."""
    if method == "collective_rpc":
        return [result for replica in results for result in replica]  # replica-major
    if method in ("reset_prefix_cache", "is_paused", "is_sleeping", "add_lora", "remove_lora"):
        return all(results)  # done only if every replica did it
    if method == "get_num_unfinished_requests":
        return sum(results)
    return results[0]


def _close_all(
    engines: list[Any],
    ctx: zmq.Context[Any],
    stop_ray: bool,
    closing: threading.Event | None = None,
) -> None:
    """At shutdown, garbage collection or exit: every replica stops, no zombie is left."""
    if closing is not None:
        closing.set()  # replica restarts give up
    for engine in engines:
        try:
            engine.stop()
        except Exception:
            logger.exception("could not stop data-parallel replica %d", engine.engine_index)
    for engine in engines:
        try:
            engine.close()
        except Exception:
            logger.exception("could not close data-parallel replica %d", engine.engine_index)
    stop_authenticator(ctx)
    ctx.term()
    if stop_ray:
        import ray

        ray.shutdown()


def _handshake_off_loop(engine: Any, timeout: float) -> EngineCoreReadyResponse:
    """The handshake from a plain thread: an asyncio socket is read through a blocking
    shadow of itself (its futures need the event loop)."""
    socket = engine.output_socket
    if isinstance(socket, zmq.asyncio.Socket):
        engine.output_socket = zmq.Socket.shadow(socket.underlying)
    try:
        ready: EngineCoreReadyResponse = engine.handshake(timeout)
        return ready
    finally:
        engine.output_socket = socket


class _DPClientBase(EngineCoreClient):
    def __init__(self, config: EngineConfig, ctx: zmq.Context[Any]) -> None:
        par = config.parallel
        self.config = config
        self.ctx = ctx
        self.size = par.data_parallel_size
        self.coordinator = DPCoordinator(self.size, external_lb=par.data_parallel_external_lb)
        # Local replicas talk over owner-only IPC; Ray replicas over TCP: msgpack only.
        owner_only = par.data_parallel_backend == "mp"
        self.encoder = MsgpackEncoder(allow_pickle=owner_only)
        self.decoder = MsgpackDecoder(EngineCoreOutputs, allow_pickle=owner_only)
        self.owner: dict[str, int] = {}  # engine request id -> replica
        self._lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._utility_futures: dict[tuple[int, int], Any] = {}
        self.dead_error: EngineDeadError | None = None
        self.sends = SendQueue()
        self.failover = par.data_parallel_failover
        # retry: requests that have produced no output yet, and those resubmitted once.
        self.unanswered: dict[str, EngineCoreRequest] = {}
        self.retried: set[str] = set()
        self.restarts = par.data_parallel_backend == "ray"
        self._closing = threading.Event()
        started_ray = False
        if par.data_parallel_backend == "ray":
            from enginecore.engine.dp_ray import ensure_ray, start_ray_engines

            started_ray = ensure_ray(config)
            try:
                self.engines: list[Any] = start_ray_engines(config, ctx)
            except BaseException:
                _close_all([], ctx, started_ray)
                raise
        else:
            self.engines = []
            try:
                for index in range(self.size):
                    self.engines.append(_EngineProcess(config, ctx, index))
            except BaseException:
                _close_all(self.engines, ctx, False)
                raise
        # The list itself: a restarted replica replaces its predecessor in it.
        self._finalizer = weakref.finalize(
            self, _close_all, self.engines, ctx, started_ray, self._closing
        )
        # Every replica loads at the same time; the handshakes are awaited in turn.
        self.readies = []
        for engine in self.engines:
            try:
                self.readies.append(engine.handshake(config.engine.ready_timeout))
            except BaseException as exc:
                self._finalizer()
                if isinstance(exc, EngineCoreError):
                    raise type(exc)(f"data-parallel replica {engine.engine_index}: {exc}") from exc
                raise
        first = self.readies[0]
        components = dict(first.components)
        lb = "external" if par.data_parallel_external_lb else "internal"
        components["data_parallel"] = (
            f"{self.size} replicas ({par.data_parallel_backend}, {lb} load balancing)"
        )
        self.ready = EngineCoreReadyResponse(
            max_model_len=min(r.max_model_len for r in self.readies),
            num_blocks=min(r.num_blocks for r in self.readies),
            block_size=first.block_size,
            max_num_seqs=first.max_num_seqs,
            components=components,
            pid=first.pid,
        )

    def pending_sends(self) -> int:
        return self.sends.pending

    # --- requests --------------------------------------------------------------------------

    def _send(self, index: int, kind: EngineCoreRequestType, payload: Any) -> None:
        frames = self.encoder.encode(payload)
        self.sends.track(
            self.engines[index].input_socket.send_multipart([kind.value, *frames], copy=False)
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        with self._lock:
            index = self.coordinator.choose(request.data_parallel_rank)
            self.owner[request.request_id] = index
            self.coordinator.on_added(index)
            if self.failover == "retry":
                self.unanswered[request.request_id] = request
        self._send(index, EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                self.unanswered.pop(request_id, None)
                self.retried.discard(request_id)
                index = self.owner.pop(request_id, None)
                if index is not None:
                    self.coordinator.on_done(index)
                    by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            if index not in self.coordinator.dead:
                with contextlib.suppress(EngineDeadError):  # its requests failed already
                    self._send(index, EngineCoreRequestType.ABORT, ids)

    def wire_problem(self) -> str | None:
        """Why the replicas' TCP sockets are not guarded (their key-checking or
        handshake-watching thread died), or None; ``/health`` answers 503 with it."""
        return authenticator_problem(self.ctx)

    def engine_of(self, request_id: str) -> int | None:
        """The replica serving an engine request (None once it finished)."""
        return self.owner.get(request_id)

    # --- outputs ---------------------------------------------------------------------------

    def _on_frames(self, index: int, frames: list[Any]) -> EngineCoreOutputs | None:
        """Route one message from replica ``index``; returns outputs for the frontend."""
        outputs: EngineCoreOutputs = self.decoder.decode(frames)
        outputs.engine_index = index
        if index in self.coordinator.dead:
            # Sent before it died, read after: its requests were failed or resubmitted.
            return None
        if outputs.utility_output is not None:
            future = self._utility_futures.pop((index, outputs.utility_output.call_id), None)
            if future is not None and not future.done():
                _resolve(future, outputs.utility_output)
            return None
        if outputs.engine_dead is not None:
            self._replica_died(index, f"the engine core died: {outputs.engine_dead}")
            return None
        finished = [o.request_id for o in outputs.outputs if o.finish_reason is not None]
        with self._lock:
            if self.unanswered:
                for output in outputs.outputs:
                    self.unanswered.pop(output.request_id, None)
            for request_id in finished:
                self.retried.discard(request_id)
                if self.owner.pop(request_id, None) is not None:
                    self.coordinator.on_served(index)
            if outputs.scheduler_stats is not None:
                self.coordinator.on_stats(index, outputs.scheduler_stats)
        return outputs

    def _check_liveness(self) -> None:
        for index in self.coordinator.alive():
            engine = self.engines[index]
            if not engine.is_alive():
                self._replica_died(index, f"{engine.exit_text()} unexpectedly")

    def _replica_died(self, index: int, reason: str) -> None:
        with self._lock:
            if index in self.coordinator.dead:
                return
            self.coordinator.on_dead(index, reason)
            lost = {rid for rid, owner in self.owner.items() if owner == index}
            for request_id in lost:
                del self.owner[request_id]
            resubmit = self._take_retries(lost)
            all_dead = not self.coordinator.alive()
        error = EngineDeadError(f"data-parallel replica {index} died: {reason}")
        # Its sockets are never used again: the live replicas' stay, the frontend serves on.
        self.engines[index].remove_files()
        failed = lost - {request.request_id for _, request in resubmit}
        logger.error("%s (%d requests lost, %d resubmitted)", error, len(failed), len(resubmit))
        for key in [k for k in list(self._utility_futures) if k[0] == index]:
            future = self._utility_futures.pop(key, None)
            if future is not None and not future.done():
                future.set_exception(error)
        if all_dead:
            self.dead_error = EngineDeadError(f"every data-parallel replica is dead; last: {error}")
            self._put(self.dead_error)
            return
        self._put(
            EngineCoreOutputs(
                engine_index=index, engine_dead=str(error), finished_requests=failed
            ).stamp()
        )
        for target, request in resubmit:
            self._resubmit(target, request, error)
        if self.restarts and not self._closing.is_set():
            threading.Thread(
                target=self._restart_replica,
                args=(index,),
                name=f"enginecore-dp-restart-{index}",
                daemon=True,
            ).start()

    def _take_retries(self, lost: set[str]) -> list[tuple[int, EngineCoreRequest]]:
        """(new replica, request) for each lost request that may be retried (under the
        lock): no output yet, not retried before, not pinned to a rank."""
        if self.failover != "retry" or not self.coordinator.alive():
            return []
        resubmit = []
        for request_id in sorted(lost):
            request = self.unanswered.pop(request_id, None)
            if (
                request is None
                or request_id in self.retried
                or request.data_parallel_rank is not None
            ):
                continue
            target = self.coordinator.choose()
            self.owner[request_id] = target
            self.coordinator.on_added(target)
            self.retried.add(request_id)
            self.unanswered[request_id] = request
            resubmit.append((target, request))
        return resubmit

    def _resubmit(self, target: int, request: EngineCoreRequest, cause: EngineDeadError) -> None:
        logger.warning(
            "request %s resubmitted to data-parallel replica %d after: %s",
            request.request_id,
            target,
            cause,
        )
        with contextlib.suppress(EngineDeadError):  # then that replica's death fails it
            self._send(target, EngineCoreRequestType.ADD, request)

    # --- restarts (Ray) --------------------------------------------------------------------

    def _restart_replica(self, index: int) -> None:
        """Frees the dead replica's placement group, then starts a new one for it, waiting
        as long as it takes for a node with room; hands it to :meth:`_install`."""
        from enginecore.engine.dp_ray import RayEngine, replicas_use_gpu

        old = self.engines[index]
        with contextlib.suppress(Exception):
            old.release()
        attempt = 0
        while not self._closing.is_set():
            attempt += 1
            engine = None
            try:
                engine = RayEngine(
                    self.config,
                    self.ctx,
                    index,
                    None,  # wherever Ray finds room: the returning node
                    replicas_use_gpu(self.config),
                    keep_waiting=lambda: not self._closing.is_set(),
                )
                ready = _handshake_off_loop(engine, self.config.engine.ready_timeout)
            except Exception as exc:
                if engine is not None:
                    with contextlib.suppress(Exception):
                        engine.close()
                if self._closing.is_set():
                    return
                logger.warning(
                    "restart %d of data-parallel replica %d failed: %s", attempt, index, exc
                )
                self._closing.wait(min(2.0 * attempt, 30.0))
                continue
            if self._closing.is_set():
                engine.stop()
                engine.close()
                return
            logger.warning(
                "data-parallel replica %d restarted on node %s (pid %d)",
                index,
                engine.node_id[:12],
                ready.pid,
            )
            self._install(index, engine)
            return

    def _install(self, index: int, engine: Any) -> None:
        """Puts a restarted replica in service (in the thread that reads outputs)."""
        raise NotImplementedError

    def _swap_in(self, index: int, engine: Any) -> Any:
        """The replica's new engine replaces the old, which is returned (to be closed)."""
        old = self.engines[index]
        self.engines[index] = engine
        with self._lock:
            self.coordinator.on_restarted(index)
        return old

    def _put(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        raise NotImplementedError

    # --- utilities -------------------------------------------------------------------------

    def _utility_targets(self, engine_index: int | None) -> list[int]:
        if self.dead_error is not None:
            raise self.dead_error
        if engine_index is None:
            return self.coordinator.alive()
        if engine_index in self.coordinator.dead:
            raise EngineDeadError(f"data-parallel replica {engine_index} is dead")
        return [engine_index]

    def _start_utility(self, index: int, method: str, args: tuple[Any, ...], future: Any) -> None:
        call_id = next(self._call_ids)
        self._utility_futures[(index, call_id)] = future
        self._send(index, EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        if index in self.coordinator.dead:  # died while the call was being registered
            self._utility_futures.pop((index, call_id), None)
            if not future.done():
                future.set_exception(EngineDeadError(f"data-parallel replica {index} is dead"))

    def shutdown(self) -> None:
        self._closing.set()
        self._finalizer()


class DPSyncMPClient(_DPClientBase):
    """Used by ``LLM``: one reader thread polls every replica's output socket."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, zmq.Context())
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._stop = threading.Event()
        self._installs: queue.Queue[tuple[int, Any]] = queue.Queue()
        # A socket is not thread-safe: ``LLM.remove_lora`` may send from another thread
        # while ``generate`` sends aborts.
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_outputs, daemon=True)
        self._reader.start()

    def _put(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self.outputs.put(item)

    def _send(self, index: int, kind: EngineCoreRequestType, payload: Any) -> None:
        """Never blocks on a dead replica: a PUSH socket whose peer is gone would wait
        forever, so a full or peerless socket is a cue to check the replica's life."""
        frames = [kind.value, *self.encoder.encode(payload)]
        with self._send_lock:
            self._send_frames(index, frames)

    def _send_frames(self, index: int, frames: list[Any]) -> None:
        engine = self.engines[index]
        while True:
            try:
                engine.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if not engine.is_alive():
                    self._replica_died(index, f"{engine.exit_text()} unexpectedly")
                    raise EngineDeadError(f"data-parallel replica {index} is dead") from None
                engine.input_socket.poll(LIVENESS_POLL_MS, zmq.POLLOUT)

    def _install(self, index: int, engine: Any) -> None:
        self._installs.put((index, engine))

    def _take_installs(self, poller: zmq.Poller, sockets: dict[Any, int]) -> None:
        """Restarted replicas: their output sockets replace their predecessors'."""
        while True:
            try:
                index, engine = self._installs.get_nowait()
            except queue.Empty:
                return
            old = self._swap_in(index, engine)
            poller.unregister(old.output_socket)
            del sockets[old.output_socket]
            with contextlib.suppress(Exception):
                old.close()
            sockets[engine.output_socket] = index
            poller.register(engine.output_socket, zmq.POLLIN)

    def _read_outputs(self) -> None:
        poller = zmq.Poller()
        sockets = {e.output_socket: e.engine_index for e in self.engines}
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        last_check = time.monotonic()
        while not self._stop.is_set() and self.dead_error is None:
            self._take_installs(poller, sockets)
            try:
                ready = dict(poller.poll(LIVENESS_POLL_MS))
            except zmq.ZMQError:
                return
            if self._stop.is_set():
                return
            # Checked on a clock, not only when all is quiet: a busy replica must not
            # hide a dead one.
            if time.monotonic() - last_check >= LIVENESS_POLL_MS / 1000:
                last_check = time.monotonic()
                self._check_liveness()
            for sock in ready:
                try:
                    frames = sock.recv_multipart(copy=False)
                except zmq.ZMQError:
                    return
                outputs = self._on_frames(sockets[sock], frames)
                if outputs is not None:
                    self.outputs.put(outputs)

    def get_output(self) -> EngineCoreOutputs:
        return take_output(self.outputs)

    def call_utility(self, method: str, *args: Any, engine_index: int | None = None) -> Any:
        """Runs on every live replica (or only ``engine_index``); answers combined."""
        futures = []
        for index in self._utility_targets(engine_index):
            future: Future[Any] = Future()
            self._start_utility(index, method, args, future)
            futures.append(future)
        results = [f.result() for f in futures]
        return results[0] if engine_index is not None else combine_utility_results(method, results)

    def shutdown(self) -> None:
        self._stop.set()
        super().shutdown()


class DPAsyncMPClient(_DPClientBase):
    """Used by ``AsyncLLM``: one asyncio task per replica reads its output socket."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, zmq.asyncio.Context())
        self.outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._readers: list[asyncio.Task[Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure_reader(self) -> None:
        if not self._readers:
            self.outputs = asyncio.Queue()
            loop = self._loop = asyncio.get_running_loop()
            self._readers = [
                loop.create_task(self._read_outputs(i), name=f"enginecore-dp-{i}")
                for i in range(self.size)
            ]

    def _install(self, index: int, engine: Any) -> None:
        if self._loop is None:  # nothing reads yet: the first reader takes it
            with contextlib.suppress(Exception):
                self._swap_in(index, engine).close()
            return
        try:
            self._loop.call_soon_threadsafe(self._install_on_loop, index, engine)
        except RuntimeError:  # the loop is closed: the frontend is going away
            engine.stop()
            engine.close()

    def _install_on_loop(self, index: int, engine: Any) -> None:
        old = self._swap_in(index, engine)  # its reader ended when it died
        with contextlib.suppress(Exception):
            old.close()
        assert self._loop is not None  # set when the first reader started
        self._readers.append(
            self._loop.create_task(self._read_outputs(index), name=f"enginecore-dp-{index}")
        )

    def _put(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        if self.outputs is not None:
            self.outputs.put_nowait(item)

    async def _read_outputs(self, index: int) -> None:
        engine = self.engines[index]
        while index not in self.coordinator.dead and self.dead_error is None:
            if not await engine.output_socket.poll(LIVENESS_POLL_MS):
                if not engine.is_alive():
                    self._replica_died(index, f"{engine.exit_text()} unexpectedly")
                continue
            frames = await engine.output_socket.recv_multipart(copy=False)
            outputs = self._on_frames(index, frames)
            if outputs is not None:
                self._put(outputs)

    def get_output(self) -> EngineCoreOutputs:
        raise TypeError("DPAsyncMPClient: use 'await get_output_async()'")

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self.outputs is not None  # made by _ensure_reader
        return await take_output_async(self.outputs)

    def call_utility(self, method: str, *args: Any) -> Any:
        raise TypeError("DPAsyncMPClient: use 'await call_utility_async(...)'")

    async def call_utility_async(
        self, method: str, *args: Any, engine_index: int | None = None
    ) -> Any:
        """Runs on every live replica (or only ``engine_index``); answers combined."""
        self._ensure_reader()
        loop = asyncio.get_running_loop()
        futures = []
        for index in self._utility_targets(engine_index):
            future = loop.create_future()
            self._start_utility(index, method, args, future)
            futures.append(future)
        results = await asyncio.gather(*futures)
        return results[0] if engine_index is not None else combine_utility_results(method, results)

    def shutdown(self) -> None:
        for reader in self._readers:
            reader.cancel()
        super().shutdown()
