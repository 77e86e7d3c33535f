"""The ``uni`` executor: one worker inside the engine-core process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from enginecore.config import EngineConfig
from enginecore.engine.inputs_staged import InputsStaged
from enginecore.engine.serial_thread import SerialThread
from enginecore.errors import ConfigError, RankError
from enginecore.interfaces import Executor, WorkerSpec
from enginecore.registry import import_ref
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore_executors.rpc import check_reply_rank, method_name

__all__ = ["RankError", "UniProcExecutor", "method_name"]


class UniProcExecutor(Executor):
    """Runs the worker in this process. ``non_block`` calls run on one background thread
    (torch releases the GIL in its kernels), so the engine can schedule the next batch
    while this one computes."""

    gathers_all_ranks = False  # one local worker (external_launcher: one rank of many)

    def __init__(self, config: EngineConfig, worker_spec: WorkerSpec, plugin_host: Any = None):
        super().__init__(config, worker_spec)
        self.max_concurrent_batches = 2 if config.scheduler.async_scheduling else 1
        # A daemon thread: a plugin hung in a forward pass must not keep the process alive.
        self._thread = SerialThread("enginecore-uni")
        #: The last step launched without blocking: the engine thread waits for its
        #: inputs to be staged before its own work (:mod:`enginecore.engine.inputs_staged`).
        self.inputs_staged: InputsStaged | None = None
        self.worker = self._build_worker(plugin_host)
        # Every torch call runs on the one worker thread, loading included: with libgomp,
        # a second thread that has ever run an OpenMP region keeps its own thread team,
        # and two teams on the same cores make every later parallel region sleep and wake
        # instead of spinning (small ops in a decode step ran up to 10x slower).
        self._thread.submit(self._start_worker).result()

    def _start_worker(self) -> None:
        self.worker.init_device()
        self.worker.load_model()

    def _build_worker(self, plugin_host: Any) -> Any:
        if self.config.parallel.world_size != 1:
            raise ConfigError(
                f"executor 'uni' runs one worker, but tensor_parallel_size * "
                f"pipeline_parallel_size = {self.config.parallel.world_size}; use executor "
                "'mp' (or 'ray', or 'external_launcher' under torchrun)"
            )
        worker_cls = import_ref(self.worker_spec.worker_ref)
        return worker_cls(self.config, self.worker_spec, plugin_host=plugin_host)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Any | Future[Any]:
        check_reply_rank(unique_reply_rank, self.config.parallel.world_size)
        fn = self.worker.resolve_method(method)
        kwargs = kwargs or {}

        staged = self._staged_step(method, non_block)

        def call() -> Any:
            try:
                result = fn(*args, **kwargs) if staged is None else staged.run(fn, *args, **kwargs)
            except Exception as exc:
                raise RankError(self.worker.rank, method_name(method), exc) from exc
            return result if unique_reply_rank is not None else [result]

        if non_block:
            launched = self._thread.submit(call)
            if staged is not None:  # also where the call never runs (cancelled at shutdown)
                launched.add_done_callback(staged.release)
            return launched
        # Blocking calls still go through the thread, so they queue behind in-flight work
        # in order instead of racing it.
        future = self._thread.submit(call)
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"collective_rpc {method_name(method)!r} timed out after {timeout} s "
                f"on rank {self.worker.rank}"
            ) from None

    def _launch_step(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> tuple[Future[Any], Future[Any]]:
        """Both halves of the step as one call on the worker thread: one future, one
        wake of the worker, and one of the engine thread when the step's output is
        ready (with two calls, the engine thread woke once the forward returned, then
        waited again, taking the interpreter lock from the worker's sampling)."""
        cls = type(self)
        if (
            self.kv_output_aggregator is not None
            or cls.execute_model is not Executor.execute_model
            or cls.sample_tokens is not Executor.sample_tokens
        ):  # a subclass's own halves are called as it defines them
            return super()._launch_step(scheduler_output, grammar_output)
        worker = self.worker
        execute = worker.resolve_method("execute_model")
        sample = worker.resolve_method("sample_tokens")
        staged = self.inputs_staged = InputsStaged()

        def call() -> Any:
            try:
                executed = staged.run(execute, scheduler_output)
            except Exception as exc:
                raise RankError(worker.rank, "execute_model", exc) from exc
            try:
                sampled = sample(grammar_output)
            except Exception as exc:
                raise RankError(worker.rank, "sample_tokens", exc) from exc
            return executed if executed is not None else sampled

        launched = self._thread.submit(call)
        launched.add_done_callback(staged.release)  # also where it never runs (shutdown)
        return launched, launched

    def _staged_step(self, method: object, non_block: bool) -> InputsStaged | None:
        """A signal for a step's ``execute_model`` launched without blocking, kept as
        :attr:`inputs_staged`; None for any other call."""
        if not non_block or method != "execute_model":
            return None
        self.inputs_staged = InputsStaged()
        return self.inputs_staged

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        shutdown = getattr(self.worker, "shutdown", None)
        if shutdown is not None:
            shutdown()
