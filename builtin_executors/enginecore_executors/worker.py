"""The generic Worker: one rank that owns a device and a model runner.

The same class serves every executor (uni, mp, ray, external_launcher): executors only
differ in where the worker lives and how calls reach it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from enginecore.config import EngineConfig, ParallelConfig
from enginecore.distributed import (
    SINGLE_RANK,
    ParallelContext,
    destroy_distributed,
    init_distributed,
    local_replica_index,
    resolve_backend,
    resolve_device_type,
)
from enginecore.errors import EngineCoreError
from enginecore.interfaces import ModelRunner, WorkerSpec
from enginecore.interfaces import Worker as WorkerABC
from enginecore.registry import import_ref
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore_executors.devices import (
    accelerator_index,
    check_accelerator_index,
    replica_cpu_cores,
)
from enginecore_executors.rpc_watchdog import call_within

if TYPE_CHECKING:
    from enginecore_executors.step_trace import StepTracer

logger = logging.getLogger(__name__)


class UnknownWorkerMethodError(EngineCoreError, AttributeError):
    """collective_rpc named a method no worker has and no plugin registered."""


def resolve_device(config: EngineConfig, local_rank: int = 0, replica: int = 0) -> torch.device:
    """The rank's device: on CUDA, ordinal ``replica * world_size + local_rank`` (each local
    data-parallel replica owns its own devices), with a clear error when there are too few."""
    wanted = resolve_device_type(config.model.device)
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise EngineCoreError("device 'cuda' was requested but torch sees no CUDA device")
        index = accelerator_index(config.parallel, local_rank, replica)
        check_accelerator_index(config.parallel, index, torch.cuda.device_count(), replica)
        return torch.device("cuda", index)
    return torch.device("cpu")


# A step with at least this many prompt tokens runs on the reserved cores too.
BURST_MIN_PREFILL_TOKENS = 512


def cpu_threads_per_rank(par: ParallelConfig, reserve: bool = True) -> int:
    """Torch threads for one CPU rank: the cores this process may run on, less those
    reserved for the frontend (unless ``reserve`` is false), shared by the ranks on this
    host.

    Ranks on one host share its cores, and oversubscribed threads slow every rank; local
    data-parallel replicas (backend mp) share them too (Ray sizes its actors itself).
    The frontend needs a core of its own while serving: an OpenMP team that shares its
    cores with the HTTP server stalls at every barrier where one of its threads was
    preempted (``cpu_reserved_cores``).
    """
    local_ranks = par.world_size
    if par.data_parallel_backend == "mp":
        local_ranks *= par.data_parallel_size
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    reserved = (par.cpu_reserved_cores or 0) if reserve else 0
    return max(1, (cores - reserved) // local_ranks)


def prefill_tokens(scheduler_output: SchedulerOutput) -> int:
    """Tokens of the step's multi-token chunks (prompts, mostly; not single decodes)."""
    return sum(n for n in scheduler_output.num_scheduled_tokens.values() if n > 1)


class Worker(WorkerABC):
    # The interface's Worker always has a runner; this one has it after load_model.
    model_runner: ModelRunner

    def __init__(
        self,
        config: EngineConfig,
        worker_spec: WorkerSpec,
        *,
        rank: int = 0,
        local_rank: int = 0,
        parallel: ParallelContext = SINGLE_RANK,
        plugin_host: Any = None,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.worker_spec = worker_spec
        self.rank = rank
        self.local_rank = local_rank
        self.parallel = parallel
        self.plugin_host = plugin_host
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self._rpcs: dict[str, Callable[..., Any]] = {}
        # CPU torch threads (set by init_device): per step, and for large prefill steps,
        # which borrow the cores reserved for the frontend (0: never).
        self.step_threads = 0
        self.burst_threads = 0
        # Set by the trace_next_steps worker RPC (a StepTracer) for the next N steps.
        self.step_tracer: StepTracer | None = None
        # This rank's local data-parallel replica (its devices and cores are that replica's).
        self.replica = local_replica_index()

    # --- start-up -----------------------------------------------------------------------

    def init_device(self) -> None:
        self.device = resolve_device(self.config, self.local_rank, self.replica)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.model.seed)
        par = self.config.parallel
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            threads = cpu_threads_per_rank(par)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            burst = cpu_threads_per_rank(par, reserve=False)
            if burst > threads:
                self.step_threads, self.burst_threads = threads, burst
                logger.info(
                    "rank %d: %d torch threads, %d for steps with %d+ prompt tokens",
                    self.rank,
                    threads,
                    burst,
                    BURST_MIN_PREFILL_TOKENS,
                )
            else:
                logger.info("rank %d: %d torch threads", self.rank, threads)
        if self.device.type == "cpu":
            self._pin_replica_cores(par)  # after sizing the threads on every core
        if par.world_size > 1 and self.parallel.world_size == 1:
            # Join the TP/PP process group (gloo on CPU, NCCL on CUDA); every rank of this
            # executor calls this at the same time with the same init_method.
            if self.distributed_init_method is None:
                raise EngineCoreError(
                    f"rank {self.rank}: world size {par.world_size} needs a "
                    "distributed_init_method from the executor"
                )
            self.parallel = init_distributed(
                rank=self.rank,
                tp_size=par.tensor_parallel_size,
                pp_size=par.pipeline_parallel_size,
                init_method=self.distributed_init_method,
                backend=resolve_backend(par.distributed_backend, self.device.type),
            )

    def _pin_replica_cores(self, par: Any) -> None:
        """Local replicas get disjoint core sets (their thread counts were sized for that:
        ``cpu_threads_per_rank`` divides the cores by the local replicas too)."""
        if not hasattr(os, "sched_setaffinity"):
            return
        cores = replica_cpu_cores(list(os.sched_getaffinity(0)), par, self.replica)
        if cores is not None:
            # Every thread of the process (affinity is per thread; new ones inherit it).
            tids = (
                [int(t) for t in os.listdir("/proc/self/task")]
                if os.path.isdir("/proc/self/task")
                else [0]
            )
            for tid in tids:
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.sched_setaffinity(tid, cores)
            logger.info("replica %d rank %d: pinned to cores %s", self.replica, self.rank, cores)

    def device_assignment(self) -> dict[str, Any]:
        """Where this rank runs: its device, accelerator ordinal, visible devices, cores."""
        node_ip = None
        ray = sys.modules.get("ray")  # only a Ray actor has it loaded: never import it here
        if ray is not None and ray.is_initialized():
            node_ip = ray.util.get_node_ip_address()
        return {
            "rank": self.rank,
            "replica": self.replica,
            "device": str(self.device),
            "accelerator_index": accelerator_index(
                self.config.parallel, self.local_rank, self.replica
            ),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cpu_cores": sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else [],
            "node_ip": node_ip,
        }

    def load_model(self) -> None:
        ref = self.worker_spec.model_runner_ref
        try:
            runner_cls = import_ref(ref)
            self.model_runner = runner_cls(
                self.config, self.worker_spec, self.device, self.parallel
            )
        except EngineCoreError:
            raise  # enginecore's own errors already say what is wrong
        except Exception as exc:
            # A bug in the runner's plugin: name it. The worker only knows the runner's
            # reference, whose module path names the package that provides it. (Errors of
            # load_model below are usually about the checkpoint and pass through as they are.)
            raise EngineCoreError(
                f"model runner {self.config.model.runner!r} ({ref}) failed to start on rank "
                f"{self.rank}: {type(exc).__name__}: {exc}. Fix the plugin that provides it, "
                "or select another runner (config key model.runner)."
            ) from exc
        self.model_runner.load_model()
        if self.plugin_host is None:
            from enginecore.plugins import make_plugin_manager

            self.plugin_host = make_plugin_manager(
                self.worker_spec.enabled_plugins, self.worker_spec.disabled_plugins
            )
        self.plugin_host.worker_started(self)

    # --- the step -----------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.burst_threads:
            self._set_step_threads(scheduler_output)
        if self.step_tracer is not None:
            return self.step_tracer.execute_model(scheduler_output)
        return self.model_runner.execute_model(scheduler_output)

    def _set_step_threads(self, scheduler_output: SchedulerOutput) -> None:
        """Large prefill steps run on the reserved cores too.

        The reservation keeps decode steps clear of the frontend's bursts (an OpenMP
        barrier waits for a preempted thread). A step prefilling many prompts at once is
        long and comes when requests arrive together: there the second thread pays off,
        while for a steady trickle of requests, one prompt per step, it does not
        (``enginecore bench serve``; benchmarks/RESULTS.md)."""
        big = prefill_tokens(scheduler_output) >= BURST_MIN_PREFILL_TOKENS
        threads = self.burst_threads if big else self.step_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self.step_tracer is not None:
            return self.step_tracer.sample_tokens(grammar_output)
        return self.model_runner.sample_tokens(grammar_output)

    # --- memory and cache ---------------------------------------------------------------

    def determine_available_memory(self) -> int:
        return self.model_runner.determine_available_memory()

    def get_kv_cache_block_bytes(self) -> int:
        return self.model_runner.get_kv_cache_block_bytes()

    def get_max_model_len(self) -> int:
        return self.model_runner.get_max_model_len()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def sleep(self, level: int = 1) -> None:
        sleep = getattr(self.model_runner, "sleep", None)
        if sleep is None:
            raise EngineCoreError(f"model runner {type(self.model_runner).__name__} cannot sleep")
        sleep(level)

    def wake_up(self) -> None:
        wake_up = getattr(self.model_runner, "wake_up", None)
        if wake_up is None:
            raise EngineCoreError(f"model runner {type(self.model_runner).__name__} cannot wake")
        wake_up()

    def check_health(self) -> None:
        """Raises when the rank's KV connector reports a dead thread or socket."""
        bridge = getattr(self.model_runner, "kv_connector", None)
        if bridge is not None:
            bridge.connector.check_health()

    def get_pid(self) -> int:
        return os.getpid()

    def get_rank(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        """Leave the process group (a no-op at world size 1)."""
        bridge = getattr(self.model_runner, "kv_connector", None)
        if bridge is not None:
            bridge.shutdown()  # the KV connector's threads and sockets
        if self.parallel.world_size > 1:
            destroy_distributed()

    # --- RPC dispatch -------------------------------------------------------------------

    def call_registered_rpc(
        self,
        name: str,
        limit: float,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The registered worker RPC ``name``, abandoned after ``limit`` seconds (see
        :mod:`enginecore_executors.rpc_watchdog`): a hung one never holds the worker."""
        fn = self.resolve_method(name)
        return call_within(fn, name, self.rank, limit, *args, **(kwargs or {}))

    def resolve_method(self, method: str | Callable[..., Any]) -> Callable[..., Any]:
        """A bound callable for a method name, a registered worker RPC, or a function."""
        if callable(method):
            return lambda *a, **kw: method(self, *a, **kw)
        if not method.startswith("_") and callable(getattr(self, method, None)):
            bound: Callable[..., Any] = getattr(self, method)
            return bound
        fn = self._rpcs.get(method)
        if fn is None and method in self.worker_spec.worker_rpc_refs:
            fn = self._rpcs[method] = import_ref(self.worker_spec.worker_rpc_refs[method])
        if fn is None:
            registered = ", ".join(sorted(self.worker_spec.worker_rpc_refs)) or "none"
            raise UnknownWorkerMethodError(
                f"collective_rpc: no worker method or registered worker RPC named {method!r} "
                f"(registered worker RPCs: {registered})"
            )
        return lambda *a, **kw: fn(self, *a, **kw)
