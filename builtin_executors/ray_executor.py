"""The ``ray`` executor: every rank is a Ray actor, placed by a placement group.

This is how a deployment grows past one machine: the ranks may sit on any nodes of a Ray
cluster (``parallel.ray_address``), each actor hosts the same generic ``Worker`` as the
``mp`` executor, and the TP/PP process group rendezvous at rank 0's node. When no address
is configured a private local cluster is started, bound to 127.0.0.1 (never exposed).

- placement: one bundle per rank (``{"CPU": 1}``, plus ``{"GPU": 1}`` on CUDA), packed
  onto as few nodes as possible (``STRICT_PACK`` when the ranks must share a host);
- calls: the same pickled call record as ``mp`` (one ``call`` task per actor); the
  combined Future settles when every rank answered, or at the first rank error;
- death: each actor runs a ``wait_forever`` task in its own concurrency group; when the
  actor dies that task fails, and the monitor thread fails every pending call and
  reports ``rank N (pid P) died`` through the failure callbacks.

Ray is an optional dependency: ``pip install 'enginecore[ray]'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgspec

from enginecore.builtin_executors.rpc import (
    CallGate,
    RankError,
    WorkerDiedError,
    WorkerStartupError,
    decode_call,
    encode_call,
    load_call,
)
from enginecore.config import EngineConfig
from enginecore.errors import ConfigError, EngineShutdownError
from enginecore.interfaces import Executor, WorkerSpec

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("executor 'ray' needs Ray: pip install 'enginecore[ray]'") from exc
    return ray


class RayWorkerActor:
    """The process-side shim: builds the Worker on ``start`` and runs calls on it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Any = None
        self._forever = threading.Event()

    def node_ip_and_port(self) -> tuple[str, int]:
        """An address the other ranks can reach this node on (rank 0 hosts the rendezvous)."""
        import ray

        from enginecore.distributed import free_loopback_port

        ip = ray.util.get_node_ip_address()
        if ip in ("127.0.0.1", "localhost"):
            return ip, free_loopback_port()
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def start(self, config_bytes: bytes, spec_bytes: bytes, init_method: str) -> tuple:
        """Build, join the process group, load weights. Returns ``(ok, pid or error)``."""
        from enginecore.builtin_executors.mp_worker import _error_text
        from enginecore.config import EngineConfig
        from enginecore.interfaces import WorkerSpec
        from enginecore.registry import import_ref

        try:
            config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
            spec = msgspec.msgpack.decode(spec_bytes, type=WorkerSpec)
            worker_cls = import_ref(spec.worker_ref)
            self.worker = worker_cls(
                config,
                spec,
                rank=self.rank,
                local_rank=0,  # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU
                distributed_init_method=init_method,
            )
            self.worker.init_device()
            self.worker.load_model()
        except BaseException as exc:
            return False, _error_text(exc)
        return True, os.getpid()

    def call(self, data: bytes) -> tuple[bool, Any]:
        from enginecore.builtin_executors.mp_worker import _error_text

        _call_id, method, payload, reply_rank = decode_call(data)
        try:
            method, args, kwargs = load_call(method, payload)
            result = self.worker.resolve_method(method)(*args, **kwargs)
        except Exception as exc:
            return False, _error_text(exc)
        if reply_rank is not None and reply_rank != self.rank:
            result = None
        return True, result

    def wait_forever(self) -> None:
        """Never returns while the actor lives: its failure is the death notice."""
        self._forever.wait()


def _actor_class(ray: Any) -> Any:
    """The actor class (built lazily: Ray is optional). ``wait_forever`` runs in its own
    concurrency group, so the default group stays serial and keeps calls in order."""

    class EngineCoreRankActor(RayWorkerActor):
        @ray.method(concurrency_group="monitor")
        def wait_forever(self) -> None:
            self._forever.wait()

    return ray.remote(concurrency_groups={"monitor": 1})(EngineCoreRankActor)


def _combine(
    futures: list[Future], reply_rank: int | None, name: str, on_death: Callable
) -> Future:
    """One Future over every rank's Future: results by rank, or the first rank error."""
    combined: Future = Future()
    results: dict[int, Any] = {}
    lock = threading.Lock()

    def settle(fn: Callable, value: Any) -> None:
        with contextlib.suppress(InvalidStateError):
            fn(value)

    def done(rank: int, fut: Future) -> None:
        try:
            ok, payload = fut.result()
        except Exception as exc:  # the actor died (RayActorError) or the task failed
            settle(combined.set_exception, on_death(rank, exc))
            return
        if not ok:
            settle(combined.set_exception, RankError(rank, name, payload))
            return
        with lock:
            results[rank] = payload
            complete = len(results) == len(futures)
        if complete:
            value = (
                results[reply_rank]
                if reply_rank is not None
                else [results[r] for r in range(len(futures))]
            )
            settle(combined.set_result, value)

    for rank, fut in enumerate(futures):
        fut.add_done_callback(lambda f, r=rank: done(r, f))
    return combined


class RayExecutor(CallGate, Executor):
    """Ranks as Ray actors; the same Worker code as ``mp``."""

    def __init__(self, config: EngineConfig, worker_spec: WorkerSpec, plugin_host: Any = None):
        super().__init__(config, worker_spec)
        ray = self.ray = _import_ray()
        par = config.parallel
        self.world_size = par.world_size
        if config.scheduler.async_scheduling:
            self.max_concurrent_batches = max(2, par.pipeline_parallel_size)
        self._closing = False
        self._dead: str | None = None
        self._dead_rank: int | None = None
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._started_ray = False
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.placement_group: Any = None
        if not ray.is_initialized():
            if par.ray_address:
                ray.init(address=par.ray_address, log_to_driver=True)
            else:
                ray.init(
                    num_cpus=max(self.world_size, 1),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    log_to_driver=True,
                )
            self._started_ray = True
        try:
            self._start_actors()
        except BaseException:
            self._teardown()
            raise
        self._monitor_thread = threading.Thread(
            target=self._monitor_loop, name="enginecore-ray-monitor", daemon=True
        )
        self._monitor_thread.start()

    # --- start-up ---------------------------------------------------------------------------

    def _start_actors(self) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        use_gpu = self.config.model.device == "cuda" or (
            self.config.model.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {})}
        timeout = self.config.engine.ready_timeout
        # Inside a data-parallel replica on Ray, the replica's placement group already
        # holds one bundle per rank after the engine core's (bundle 0): use those.
        current = ray.util.get_current_placement_group()
        first_bundle = 0
        if current is not None and len(current.bundle_specs) >= self.world_size + 1:
            self._own_placement_group = False
            self.placement_group, first_bundle = current, 1
        else:
            self._own_placement_group = True
            self.placement_group = placement_group(
                [dict(bundle)] * self.world_size, strategy="PACK"
            )
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout)
        if not ready:
            raise WorkerStartupError(
                0,
                f"the Ray cluster could not place {self.world_size} bundles of {bundle} within "
                f"{timeout:.0f} s (cluster resources: {ray.cluster_resources()})",
            )
        actor_cls = _actor_class(ray)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=first_bundle + rank,
            )
            self.actors.append(
                actor_cls.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy,
                ).remote(rank)
            )
        ip, port = ray.get(self.actors[0].node_ip_and_port.remote(), timeout=timeout)
        init_method = f"tcp://{ip}:{port}"
        config_bytes = msgspec.msgpack.encode(self.config)
        spec_bytes = msgspec.msgpack.encode(self.worker_spec)
        refs = [a.start.remote(config_bytes, spec_bytes, init_method) for a in self.actors]
        remaining = list(refs)
        deadline = time.monotonic() + timeout
        while remaining:
            done, remaining = ray.wait(
                remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                raise WorkerStartupError(
                    refs.index(remaining[0]), f"not ready after {timeout:.0f} s"
                )
            rank = refs.index(done[0])
            try:
                ok, payload = ray.get(done[0])
            except Exception as exc:
                raise WorkerStartupError(rank, f"{type(exc).__name__}: {exc}") from None
            if not ok:
                raise WorkerStartupError(rank, payload)
        self.pids = [ray.get(r)[1] for r in refs]
        self._sentinels = [a.wait_forever.remote() for a in self.actors]

    # --- calls ------------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        timeout: float | None = None,
    ) -> list[Any] | Any | Future:
        name = self._admit_call(method, unique_reply_rank)
        data = encode_call(0, method, args, kwargs, unique_reply_rank)
        refs = [actor.call.remote(data) for actor in self.actors]
        future = _combine([r.future() for r in refs], unique_reply_rank, name, self._death_error)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        if non_block:
            return future
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"collective_rpc {name!r} timed out after {timeout} s") from None

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _death_error(self, rank: int, exc: BaseException) -> BaseException:
        pid = self.pids[rank] if rank < len(self.pids) else "?"
        return WorkerDiedError(
            f"rank {rank} (pid {pid}) died: {type(exc).__name__}: {str(exc)[:300]}", rank
        )

    # --- the death chain --------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        ray = self.ray
        while not self._closing:
            try:
                done, _ = ray.wait(self._sentinels, num_returns=1, timeout=1.0)
            except Exception:
                if self._closing:
                    return
                raise
            if not done or self._closing:
                continue
            rank = self._sentinels.index(done[0])
            try:
                ray.get(done[0])
                reason = "its monitor task returned"
            except Exception as exc:
                reason = f"{type(exc).__name__}"
            pid = self.pids[rank] if rank < len(self.pids) else "?"
            message = f"rank {rank} (pid {pid}) died ({reason})"
            logger.error("%s", message)
            with self._lock:
                self._dead, self._dead_rank = message, rank
                pending = list(self._pending)
            for future in pending:
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(WorkerDiedError(message, rank))
            self._report_failure(message)
            return

    # --- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._teardown()

    def _teardown(self) -> None:
        self._closing = True
        ray = self.ray
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None and getattr(self, "_own_placement_group", True):
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement_group)
            except Exception:
                pass
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(EngineShutdownError("the executor was shut down"))
        if self._started_ray:
            ray.shutdown()
