"""The ``ray`` executor: every rank is a Ray actor, placed by a placement group.

This is how a deployment grows past one machine: the ranks may sit on any nodes of a Ray
cluster (``parallel.ray_address``), each actor hosts the same generic ``Worker`` as the
``mp`` executor, and the TP/PP process group rendezvous through a file in an owner-only
directory when every rank is on the engine's node (no port), or else at rank 0's node
through a TCP store bound to that node's address only. When no address
is configured a private local cluster is started, bound to 127.0.0.1 (never exposed).

- placement: one bundle per rank (``{"CPU": 1}``, plus ``{"GPU": 1}`` on CUDA); each
  pipeline stage (one TP group) is its own ``STRICT_PACK`` placement group, so a TP group
  never spans nodes, and ranks are ordered by node (``ray_placement``). A shape the
  cluster cannot hold fails at once, naming what is missing. Inside a data-parallel
  replica on Ray the replica's own placement group (one node) is used instead;
- calls: the same pickled call record as ``mp`` (one ``call`` task per actor); the
  combined Future settles when every rank answered, or at the first rank error;
- steps: ``execute_model`` with ``non_block`` is held until ``sample_tokens`` and both
  go out as one ``step`` task per actor, so a step costs one Ray round, not two;
- death: each actor runs a ``wait_forever`` task in its own concurrency group; when the
  actor dies (or its node does) that task fails, and the monitor thread fails every
  pending call and reports ``rank N (pid P, node IP) died`` through the failure callbacks.

Ray is an optional dependency: ``pip install 'enginecore[ray]'``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal, overload

import msgspec

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError, EngineShutdownError, RankError
from enginecore.interfaces import Executor, WorkerSpec
from enginecore.runner_output import ModelRunnerOutput
from enginecore.runtime_dirs import make_runtime_dir
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore_executors.ray_placement import (
    Placement,
    place_ranks,
    rank_bundle,
    remove_groups,
)
from enginecore_executors.rpc import (
    CallGate,
    WorkerDiedError,
    WorkerStartupError,
    decode_call,
    encode_call,
    load_call,
)

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
        self.tasks_served = {"call": 0, "step": 0}  # how the calls arrived (one round a step)

    def rendezvous(self) -> str:
        """The TCP init_method of the ranks' process group, hosted here (rank 0): a
        socket bound on this node's address only, held until the store takes it."""
        import ray

        from enginecore.distributed import hold_rendezvous_port

        return hold_rendezvous_port(ray.util.get_node_ip_address())

    def node_id(self) -> str:
        import ray

        node: str = ray.get_runtime_context().get_node_id()
        return node

    def node_ip(self) -> str:
        import ray

        ip: str = ray.util.get_node_ip_address()
        return ip

    def start(self, config_bytes: bytes, spec_bytes: bytes, init_method: str) -> tuple[Any, ...]:
        """Build, join the process group, load weights. Returns ``(ok, pid or error)``."""
        from enginecore.config import EngineConfig
        from enginecore.interfaces import WorkerSpec
        from enginecore.registry import import_ref
        from enginecore_executors.mp_worker import _error_text

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
        from enginecore_executors.mp_worker import _error_text

        self.tasks_served["call"] += 1
        _call_id, method, payload, reply_rank = decode_call(data)
        try:
            method, args, kwargs = load_call(method, payload)
            result = self.worker.resolve_method(method)(*args, **kwargs)
        except Exception as exc:
            return False, _error_text(exc)
        if reply_rank is not None and reply_rank != self.rank:
            result = None
        return True, result

    def step(self, data: bytes) -> tuple[bool, Any]:
        """``execute_model`` then ``sample_tokens`` in one task: ``(executed, sampled)``."""
        from enginecore_executors.mp_worker import _error_text

        self.tasks_served["step"] += 1
        scheduler_output, grammar_output, reply_rank = pickle.loads(data)
        try:
            executed = self.worker.execute_model(scheduler_output)
            sampled = self.worker.sample_tokens(grammar_output)
        except Exception as exc:
            return False, _error_text(exc)
        if reply_rank is not None and reply_rank != self.rank:
            return True, None
        return True, (executed, sampled)

    def served(self) -> dict[str, int]:
        """Tasks served so far, by kind (``call``: one method; ``step``: a whole step)."""
        return dict(self.tasks_served)

    def wait_forever(self) -> None:
        """Never returns while the actor lives: its failure is the death notice."""
        self._forever.wait()


def _actor_class(ray: Any) -> Any:
    """The actor class (built lazily: Ray is optional). ``wait_forever`` runs in its own
    concurrency group, so the default group stays serial and keeps calls in order."""

    class EngineCoreRankActor(RayWorkerActor):
        @ray.method(concurrency_group="monitor")  # type: ignore[untyped-decorator]  # ray: Any here (optional)
        def wait_forever(self) -> None:
            self._forever.wait()

    return ray.remote(concurrency_groups={"monitor": 1})(EngineCoreRankActor)


#: Texts of a collective broken by a peer's death: such a rank error waits for the death.
_BROKEN_COLLECTIVE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _combine(
    futures: list[Future[Any]],
    reply_rank: int | None,
    name: str,
    on_death: Callable[..., Any],
    on_error: Callable[[int, str, str], BaseException],
) -> Future[Any]:
    """One Future over every rank's Future: results by rank, or the first rank error."""
    combined: Future[Any] = Future()
    results: dict[int, Any] = {}
    lock = threading.Lock()

    def settle(fn: Callable[..., Any], value: Any) -> None:
        with contextlib.suppress(InvalidStateError):
            fn(value)

    def done(rank: int, fut: Future[Any]) -> None:
        try:
            ok, payload = fut.result()
        except Exception as exc:  # the actor died (RayActorError) or the task failed
            settle(combined.set_exception, on_death(rank, exc))
            return
        if not ok:
            # on_error may wait for a peer's death notice: never on Ray's callback thread.
            threading.Thread(
                target=lambda: settle(combined.set_exception, on_error(rank, name, payload)),
                name="enginecore-ray-rank-error",
                daemon=True,
            ).start()
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
        fut.add_done_callback(functools.partial(done, rank))
    return combined


def _copy_outcome(source: Future[Any], target: Future[Any]) -> None:
    with contextlib.suppress(InvalidStateError):
        if source.exception() is not None:
            target.set_exception(source.exception())
        else:
            target.set_result(source.result())


class RayExecutor(CallGate, Executor):
    """Ranks as Ray actors; the same Worker code as ``mp``."""

    #: Seconds a rank error from a broken collective waits for a peer's death notice
    #: (Ray's default node health checks declare a lost node dead after ~30 s).
    DEATH_GRACE_S = 45.0

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
        self._pending: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self._started_ray = False
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.node_ips: list[str] = []
        self.placement: Placement | None = None
        self._rendezvous_dir: str | None = None
        # execute_model's scheduler output and Future, held until sample_tokens sends both.
        self._held_step: tuple[SchedulerOutput, Future[Any]] | None = None
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
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        use_gpu = self.config.model.device == "cuda" or (
            self.config.model.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        bundle = rank_bundle(use_gpu)
        timeout = self.config.engine.ready_timeout
        par = self.config.parallel
        # Inside a data-parallel replica on Ray, the replica's placement group (one node)
        # already holds one bundle per rank after the engine core's (bundle 0): use those.
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= self.world_size + 1:
            slots = [(current, 1 + rank) for rank in range(self.world_size)]
            self.placement = Placement([current], slots, owned=False)
        else:
            self.placement = place_ranks(
                ray, bundle, par.tensor_parallel_size, par.pipeline_parallel_size, timeout
            )
        actor_cls = _actor_class(ray)
        for rank, (group, bundle_index) in enumerate(self.placement.slots):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle_index
            )
            self.actors.append(
                actor_cls.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy,
                ).remote(rank)
            )
        init_method = self._rendezvous(timeout)
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
        self.node_ips = ray.get([a.node_ip.remote() for a in self.actors], timeout=timeout)
        self._sentinels = [a.wait_forever.remote() for a in self.actors]

    def _rendezvous(self, timeout: float) -> str:
        """Ranks all on this node meet through a file in an owner-only directory (no port
        at all); ranks on several nodes through a TCP store bound to rank 0's node
        address only (torch's store is unauthenticated: keep those nodes on a private
        network)."""
        ray = self.ray
        nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=timeout)
        if set(nodes) == {ray.get_runtime_context().get_node_id()}:
            self._rendezvous_dir = make_runtime_dir("ray-")  # mode 0700
            return f"file://{self._rendezvous_dir}/rendezvous"
        init_method: str = ray.get(self.actors[0].rendezvous.remote(), timeout=timeout)
        return init_method

    # --- calls ------------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Any | Future[Any]:
        self._send_held_step()
        return self._submit("call", method, args, kwargs, non_block, unique_reply_rank, timeout)

    def _submit(
        self,
        actor_method: str,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One task per actor (``call`` with a call record, or ``step``); one Future."""
        name = self._admit_call(method, unique_reply_rank)
        if actor_method == "step":
            data = pickle.dumps((*args, unique_reply_rank), protocol=5)
        else:
            data = encode_call(0, method, args, kwargs, unique_reply_rank)
        refs = [getattr(actor, actor_method).remote(data) for actor in self.actors]
        future = _combine(
            [r.future() for r in refs],
            unique_reply_rank,
            name,
            self._death_error,
            self._rank_error,
        )
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        if non_block:
            return future
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"collective_rpc {name!r} timed out after {timeout} s") from None

    # --- the step: one Ray round -------------------------------------------------------------

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[Any]: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = ...
    ) -> ModelRunnerOutput | None: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[Any] | None:
        """Held (non_block) until ``sample_tokens``, which sends both as one ``step``."""
        self._send_held_step()
        if not non_block:
            return super().execute_model(scheduler_output)
        future: Future[Any] = Future()
        self._held_step = (scheduler_output, future)
        return future

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[True]
    ) -> Future[Any]: ...

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[False] = ...
    ) -> ModelRunnerOutput: ...

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[Any]:
        held, self._held_step = self._held_step, None
        if held is None:
            if non_block:
                return super().sample_tokens(grammar_output, True)
            return super().sample_tokens(grammar_output)
        scheduler_output, executed = held
        aggregator = self.kv_output_aggregator  # every rank's KV transfers count
        step = self._submit(
            "step",
            "execute_model+sample_tokens",
            (scheduler_output, grammar_output),
            non_block=True,
            unique_reply_rank=None if aggregator else self.output_rank,
        )
        sampled: Future[Any] = Future()

        def split(done: Future[Any]) -> None:
            error = done.exception()
            with contextlib.suppress(InvalidStateError):
                if error is not None:
                    executed.set_exception(error)
                    sampled.set_exception(error)
                elif aggregator is None:
                    executed.set_result(done.result()[0])
                    sampled.set_result(done.result()[1])
                else:
                    pairs = done.result()
                    rank = self.output_rank
                    executed.set_result(aggregator.merge_outputs([p[0] for p in pairs], rank))
                    sampled.set_result(aggregator.merge_outputs([p[1] for p in pairs], rank))

        step.add_done_callback(split)
        return sampled if non_block else sampled.result()

    def _send_held_step(self) -> None:
        """Anything but this step's ``sample_tokens`` comes next: send the held execute."""
        held, self._held_step = self._held_step, None
        if held is None:
            return
        scheduler_output, executed = held
        sent = super().execute_model(scheduler_output, non_block=True)
        sent.add_done_callback(lambda done: _copy_outcome(done, executed))

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _rank_error(self, rank: int, method: str, text: str) -> BaseException:
        """A rank raised. When a peer's node or process died and broke the collective,
        report that death (Ray notices it within its health-check period) instead."""
        if self.world_size > 1 and any(marker in text for marker in _BROKEN_COLLECTIVE):
            deadline = time.monotonic() + self.DEATH_GRACE_S
            while self._dead is None and not self._closing and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._dead is not None:
                return WorkerDiedError(self._dead, self._dead_rank)
        return RankError(rank, method, text)

    def _death_error(self, rank: int, exc: BaseException) -> BaseException:
        return WorkerDiedError(
            f"{self._describe_rank(rank)} died: {type(exc).__name__}: {str(exc)[:300]}", rank
        )

    def _describe_rank(self, rank: int) -> str:
        pid = self.pids[rank] if rank < len(self.pids) else "?"
        node = f", node {self.node_ips[rank]}" if rank < len(self.node_ips) else ""
        return f"rank {rank} (pid {pid}{node})"

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
            except Exception as exc:  # ActorDiedError: says whether the node was lost
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            message = f"{self._describe_rank(rank)} died ({reason})"
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
        if self.placement is not None:
            remove_groups(self.placement)
        held, self._held_step = self._held_step, None
        if held is not None:
            with contextlib.suppress(InvalidStateError):
                held[1].set_exception(EngineShutdownError("the executor was shut down"))
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(EngineShutdownError("the executor was shut down"))
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
        if self._started_ray:
            ray.shutdown()
