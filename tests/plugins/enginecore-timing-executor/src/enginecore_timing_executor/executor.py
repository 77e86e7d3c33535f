"""``TimingExecutor``: wraps the executor named in its settings and times every RPC.

At shutdown it writes one JSON object per RPC method (calls, total seconds) to the
settings' ``report_path``.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import msgspec

from enginecore.interfaces import Executor
from enginecore.plugins import make_plugin_manager


class TimingSettings(msgspec.Struct, kw_only=True):
    """The ``[plugins.timing_executor]`` table."""

    inner: str = "uni"
    report_path: str | None = None


class TimingExecutor(Executor):
    def __init__(self, config, worker_spec, *, settings: TimingSettings | None = None) -> None:
        super().__init__(config, worker_spec)
        self.settings = settings or TimingSettings()
        host = make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
        inner_cls = host.registry("executor").get(self.settings.inner)
        self.inner = inner_cls(config, worker_spec)
        self.max_concurrent_batches = self.inner.max_concurrent_batches
        self.inner.register_failure_callback(self._report_failure)
        self.calls: dict[str, list[float]] = defaultdict(list)

    @property
    def output_rank(self) -> int:
        return self.inner.output_rank

    def collective_rpc(
        self,
        method,
        timeout=None,
        args=(),
        kwargs=None,
        non_block=False,
        unique_reply_rank=None,
    ) -> Any:
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        started = time.perf_counter()
        result = self.inner.collective_rpc(
            method,
            timeout=timeout,
            args=args,
            kwargs=kwargs,
            non_block=non_block,
            unique_reply_rank=unique_reply_rank,
        )

        def done(_: Any = None) -> None:
            self.calls[name].append(time.perf_counter() - started)

        if isinstance(result, Future):
            result.add_done_callback(done)
        else:
            done()
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()
        if self.settings.report_path:
            with open(self.settings.report_path, "w") as report:
                for name, seconds in sorted(self.calls.items()):
                    line = {"method": name, "calls": len(seconds), "seconds": sum(seconds)}
                    report.write(json.dumps(line) + "\n")
