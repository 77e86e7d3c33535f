"""Clients the frontend uses to talk to an engine core: in-process or over ZeroMQ."""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from enginecore.config import EngineConfig
from enginecore.errors import EngineDeadError
from enginecore.protocol import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest


def _merged(outputs: dict[int, EngineCoreOutputs]) -> EngineCoreOutputs:
    """One step's outputs for every client, as the one client in this process reads them."""
    merged = EngineCoreOutputs()
    for client_outputs in outputs.values():
        merged.extend(client_outputs)
        merged.scheduler_stats = client_outputs.scheduler_stats
    return merged


class EngineCoreClient(ABC):
    """The interface ``LLM`` and ``AsyncLLM`` program against."""

    ready: EngineCoreReadyResponse

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks until there are some)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def pending_sends(self) -> int:
        """Messages handed to the engine's socket that it has not taken yet (none for an
        engine in this process); the server refuses new requests past its limit."""
        return 0


class InprocClient(EngineCoreClient):
    """Runs the engine core in this process: each ``get_output`` runs engine steps.

    For debugging (``multiprocessing = false``) and for ``external_launcher``. Every call
    into the engine runs on its own thread within a limit (:mod:`.inproc_watchdog`): a
    plugin that hangs fails the call, naming the plugin, instead of the frontend."""

    def __init__(self, config: EngineConfig, plugin_host: Any = None) -> None:
        from enginecore.engine.core import EngineCore
        from enginecore.engine.inproc_watchdog import EngineWatchdog
        from enginecore.plugins import make_plugin_manager

        self.config = config
        host = plugin_host or make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
        self._watchdog = EngineWatchdog(host)
        limit = config.engine.ready_timeout
        try:
            self.engine = self._watchdog.call(
                limit,
                f"it was not ready within {limit:g} s (engine.ready_timeout)",
                EngineCore,
                config,
                host,
            )
        except BaseException:
            self._watchdog.close()
            raise
        self.ready = self.engine.ready_response()
        self.engine.send_plain_steps_as_columns()  # the frontends read them
        self._step = self.engine.step_fn()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread within ``engine.execute_timeout``."""
        limit = self.config.engine.execute_timeout
        if limit is not None:
            what = f"{what} took longer than {limit:g} s (engine.execute_timeout)"
        return self._watchdog.call(limit, what, fn, *args)

    def add_request(self, request: EngineCoreRequest) -> None:
        refusal = self.engine.admission_refusal()
        if refusal is not None:
            from enginecore.engine.async_llm import RequestRejectedError

            raise RequestRejectedError(refusal)
        self._call("adding a request", self.engine.add_request, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._watchdog.dead_error is None:
            self._call("an abort", self.engine.abort_requests, request_ids)

    def _step_once(self) -> EngineCoreOutputs | None:
        """One step's outputs; an empty batch once there is no work; None: step again."""
        if self.engine.held_outputs:  # batches finished before the engine slept
            return _merged(self.engine.held_outputs.pop(0))
        if not self.engine.has_work():
            return EngineCoreOutputs()
        outputs, executed = self._step()
        if not outputs:
            if not executed and not self.engine.batch_queue:
                # Requests wait on work off the loop (an adapter read, a grammar, remote
                # KV): yield to it as the engine process does.
                time.sleep(0.001)
            return None
        return _merged(outputs)

    def get_output(self) -> EngineCoreOutputs:
        while (outputs := self._call("a step", self._step_once)) is None:
            pass
        stamped: EngineCoreOutputs = outputs.stamp()
        return stamped

    def call_utility(self, method: str, *args: Any) -> Any:
        call = self.engine.utilities().get(method)
        if call is None:
            raise ValueError(f"{method!r} is not a utility method of the engine core")
        if method == "collective_rpc":
            return self._call_rpc(call, *args)
        return self._call(f"the {method!r} call", call, *args)

    def _call_rpc(self, call: Callable[..., Any], *args: Any) -> Any:
        """A worker RPC within its own limit (the call's ``timeout``, else
        ``engine.rpc_timeout`` for a registered one), plus the reply's grace."""
        from enginecore.engine.core import RPC_REPLY_GRACE

        method, timeout = [*args, None, None][:2]
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        registered = isinstance(method, str) and method in self.engine.plugins.registry(
            "worker_rpc"
        )
        if timeout is None and registered:
            timeout = self.config.engine.rpc_timeout
        if timeout is None:
            return self._call(f"collective_rpc {name!r}", call, *args)
        limit = timeout + RPC_REPLY_GRACE
        what = f"collective_rpc {name!r} did not return within {limit:g} s (its timeout)"
        return self._watchdog.call(limit, what, call, *args)

    def shutdown(self) -> None:
        if self._watchdog.dead_error is None:
            with contextlib.suppress(EngineDeadError):  # logged; the engine is abandoned
                self._call("the shutdown", self.engine.shutdown)
        self._watchdog.close()


def use_multiprocessing(config: EngineConfig) -> bool:
    if config.parallel.executor == "external_launcher":
        return False  # every torchrun rank is a whole engine, in its own process already
    env = os.environ.get("ENGINECORE_MULTIPROCESSING")
    if env is not None:
        return env.strip().lower() not in ("0", "false", "no", "off")
    return config.engine.multiprocessing


def make_client(
    config: EngineConfig,
    *,
    asyncio_mode: bool = False,
    while_starting: Callable[[], None] | None = None,
) -> EngineCoreClient:
    """The client for this config: ``engine.multiprocessing`` (ENGINECORE_MULTIPROCESSING wins).

    ``while_starting`` runs in this thread while a single engine process boots (its imports
    and model load take seconds), or before the engine when that overlap is not possible.
    If it raises, the engine is stopped and its error propagates."""
    from enginecore.engine.mp_client import AsyncMPClient, SyncMPClient

    if config.parallel.data_parallel_size == 1 and (asyncio_mode or use_multiprocessing(config)):
        client_cls = AsyncMPClient if asyncio_mode else SyncMPClient
        return client_cls(config, while_starting)
    if while_starting is not None:
        while_starting()
    if config.parallel.data_parallel_size > 1:
        return _make_dp_client(config, asyncio_mode)
    return InprocClient(config)


def start_engine(
    config: EngineConfig, *, asyncio_mode: bool = False, plugins: Any = None
) -> tuple[EngineCoreClient, Any]:
    """The engine's client and the model's tokenizer. The tokenizer (and transformers and
    torch, which it imports) loads in this process while the engine process starts, so
    the two overlap.

    The model path, and the component names, are checked first: a mistake fails before
    any process starts. A caller that passes its own ``plugins`` (``LLM``, ``AsyncLLM``)
    has checked the names against them already, before building its stat loggers."""
    from enginecore.component_check import check_components
    from enginecore.engine.model_defaults import configured_chat_template
    from enginecore.engine.preflight import (
        check_model_path,
        check_parallel_layout,
        warn_unused_memory_settings,
    )
    from enginecore.engine.tokenizer import load_tokenizer
    from enginecore.plugins import make_plugin_manager
    from enginecore.writable_dirs import check_writable_dirs

    check_model_path(config)
    check_parallel_layout(config)
    check_writable_dirs(config)
    configured_chat_template(config)  # a missing template file fails here
    if plugins is None:
        check_components(
            config, make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
        )

    loaded: list[Any] = []

    def while_starting() -> None:
        from enginecore.distributed import resolve_device_type

        warn_unused_memory_settings(config, resolve_device_type(config.model.device))
        loaded.append(load_tokenizer(config))
        for work in _ALONGSIDE.get():
            work()

    client = make_client(config, asyncio_mode=asyncio_mode, while_starting=while_starting)
    return client, loaded[0]


_ALONGSIDE: contextvars.ContextVar[tuple[Callable[[], object], ...]] = contextvars.ContextVar(
    "enginecore_alongside_engine_start", default=()
)


@contextlib.contextmanager
def alongside_engine_start(work: Callable[[], object]) -> Iterator[None]:
    """Run ``work`` in this thread while an engine started inside the block boots (after
    the tokenizer, before the engine's handshake is awaited). ``enginecore serve`` imports
    its HTTP app there, in time the frontend would spend waiting. If it raises, the
    engine is stopped and its error propagates, as a tokenizer's does."""
    token = _ALONGSIDE.set((*_ALONGSIDE.get(), work))
    try:
        yield
    finally:
        _ALONGSIDE.reset(token)


def _make_dp_client(config: EngineConfig, asyncio_mode: bool) -> EngineCoreClient:
    from enginecore.engine.dp_client import DPAsyncMPClient, DPSyncMPClient
    from enginecore.errors import ConfigError

    size = config.parallel.data_parallel_size
    if config.parallel.executor == "external_launcher":
        raise ConfigError(
            f"data_parallel_size {size} cannot be combined with executor 'external_launcher' "
            "(every torchrun rank is a whole engine already): launch one torchrun job per "
            "replica instead, or use executor 'uni', 'mp' or 'ray'"
        )
    if not asyncio_mode and not use_multiprocessing(config):
        raise ConfigError(
            f"data_parallel_size {size} runs each replica in its own process: set "
            "multiprocessing = true (and unset ENGINECORE_MULTIPROCESSING=0)"
        )
    return DPAsyncMPClient(config) if asyncio_mode else DPSyncMPClient(config)
