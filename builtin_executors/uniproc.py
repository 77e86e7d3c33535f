"""The ``uni`` executor: one worker inside the engine-core process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from enginecore.config import EngineConfig
from enginecore.errors import EngineCoreError
from enginecore.interfaces import Executor, WorkerSpec
from enginecore.registry import import_ref


class RankError(EngineCoreError):
    """A collective_rpc call raised on one rank; the message names the rank."""

    def __init__(self, rank: int, method: str, exc: BaseException) -> None:
        super().__init__(f"rank {rank} raised in {method}: {type(exc).__name__}: {exc}")
        self.rank = rank
        self.original = exc


def method_name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


class UniProcExecutor(Executor):
    """Runs the worker in this process. ``non_block`` calls run on one background thread
    (torch releases the GIL in its kernels), so the engine can schedule the next batch
    while this one computes."""

    def __init__(self, config: EngineConfig, worker_spec: WorkerSpec, plugin_host: Any = None):
        super().__init__(config, worker_spec)
        self.max_concurrent_batches = 2 if config.scheduler.async_scheduling else 1
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="enginecore-uni")
        worker_cls = import_ref(worker_spec.worker_ref)
        self.worker = worker_cls(config, worker_spec, plugin_host=plugin_host)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        timeout: float | None = None,
    ) -> list[Any] | Any | Future:
        fn = self.worker.resolve_method(method)
        kwargs = kwargs or {}

        def call() -> Any:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                raise RankError(0, method_name(method), exc) from exc
            return result if unique_reply_rank is not None else [result]

        if non_block:
            return self._thread.submit(call)
        # Blocking calls still go through the thread, so they queue behind in-flight work
        # in order instead of racing it.
        return self._thread.submit(call).result(timeout)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
