"""``EchoExecutor``: a decorator around any registered executor.

Every ``collective_rpc`` -- and therefore every ``execute_model``, ``sample_tokens``,
``determine_available_memory`` ... which the Executor base class builds on it -- is
logged (logger ``enginecore_echo_executor``, INFO) with its duration and outcome, and kept
in ``executor.records`` (the last ``max_records``). The wrapped executor is chosen by the
``ENGINECORE_ECHO_INNER`` environment variable (default ``uni``), or by subclassing and
setting ``inner``. Failure callbacks pass straight through, so the engine's death chain
works exactly as with the wrapped executor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from enginecore.interfaces import Executor, WorkerSpec

logger = logging.getLogger("enginecore_echo_executor")


@dataclass
class RpcRecord:
    seq: int
    method: str
    non_block: bool
    unique_reply_rank: int | None
    seconds: float | None = None  # None while a non_block call is in flight
    error: str | None = None


def _name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


class EchoExecutor(Executor):
    inner: str | None = None  # a registered executor name; None reads ENGINECORE_ECHO_INNER
    max_records = 10_000

    def __init__(self, config: Any, worker_spec: WorkerSpec, plugin_host: Any = None) -> None:
        super().__init__(config, worker_spec)
        from enginecore.plugins import make_plugin_manager

        name = self.inner or os.environ.get("ENGINECORE_ECHO_INNER", "uni")
        if name == "echo":
            raise ValueError("the echo executor cannot wrap itself; pick uni, mp, ray, ...")
        host = plugin_host or make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
        inner_cls = host.registry("executor").get(name)
        self.inner_name = name
        self.wrapped: Executor = inner_cls(config, worker_spec)
        self.max_concurrent_batches = self.wrapped.max_concurrent_batches
        self.wrapped.register_failure_callback(self._on_failure)
        self.records: deque[RpcRecord] = deque(maxlen=self.max_records)
        self._seq = 0
        self._lock = threading.Lock()
        logger.info("echo executor wrapping %r (%s)", name, inner_cls.__name__)

    @property
    def output_rank(self) -> int:
        return self.wrapped.output_rank

    def _on_failure(self, message: str) -> None:
        logger.error("wrapped executor failed: %s", message)
        self._report_failure(message)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Any | Future:
        with self._lock:
            self._seq += 1
            record = RpcRecord(self._seq, _name(method), non_block, unique_reply_rank)
            self.records.append(record)
        started = time.perf_counter()

        def finish(error: BaseException | None) -> None:
            record.seconds = time.perf_counter() - started
            if error is not None:
                record.error = f"{type(error).__name__}: {error}"
            logger.info(
                "rpc #%d %s%s: %.3f ms%s",
                record.seq,
                record.method,
                " (non_block)" if non_block else "",
                record.seconds * 1e3,
                f" -> {record.error}" if record.error else "",
            )

        try:
            result = self.wrapped.collective_rpc(
                method,
                args=args,
                kwargs=kwargs,
                non_block=non_block,
                unique_reply_rank=unique_reply_rank,
                timeout=timeout,
            )
        except BaseException as exc:
            finish(exc)
            raise
        if non_block and isinstance(result, Future):
            result.add_done_callback(lambda f: finish(f.exception()))
        else:
            finish(None)
        return result

    def shutdown(self) -> None:
        logger.info("echo executor: %d RPCs recorded; shutting down", self._seq)
        self.wrapped.shutdown()
