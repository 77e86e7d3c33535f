"""The watchdog of an engine core that runs in the frontend's process.

``LLM(..., multiprocessing=False)`` (and ``external_launcher``) runs the engine core in
the calling process. Every call into it (the start, each step, each utility call) runs
on one daemon thread (:class:`~enginecore.engine.serial_thread.SerialThread`) while the
frontend waits with a limit: ``engine.ready_timeout`` for the start (weight preparation
included), ``engine.execute_timeout`` for a step, the RPC's own limit for a worker RPC.
Past it the call raises :class:`~enginecore.errors.EngineDeadError` naming what hung:
the plugin and the method found on the engine's threads (the policy's ``sort_key``, an
attention forward, a KV load), else the line the engine thread is at. Every later call
raises the same error.

What stays stuck: Python cannot stop a thread, so the hung thread (and the worker thread
it may wait on) keeps running the plugin's code, holding the engine's memory (weights,
KV cache) until the process exits. Both are daemon threads: the process exits normally.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from enginecore.component_kinds import COMPONENT_KINDS, KINDS
from enginecore.engine.serial_thread import SerialThread
from enginecore.errors import EngineDeadError
from enginecore.interfaces import KVConnectorScheduler, KVConnectorWorker
from enginecore.plugin_attribution import running_plugin_call
from enginecore.plugins import PluginHost

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineWatchdog:
    """Runs the engine's calls on its own thread, each within a limit."""

    def __init__(self, host: PluginHost | None = None) -> None:
        self.host = host  # names the component a hung method belongs to
        # Threads already running are not the engine's: an engine abandoned earlier in
        # this process may still hang in plugin code, and must not be blamed again.
        self._foreign = {t.ident for t in threading.enumerate()}
        self._thread = SerialThread("enginecore-engine")
        self.dead_error: EngineDeadError | None = None

    def call(self, limit: float | None, what: str, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` on the engine thread. ``what`` describes the call and its limit in
        the error (``"a step took longer than 5 s (engine.execute_timeout)"``); ``limit``
        None waits as long as it takes."""
        if self.dead_error is None and sys.is_finalizing():
            # The interpreter is exiting with the engine still up (an LLM dropped without
            # shutdown): its daemon thread can run nothing more, so nothing is waited for.
            self.dead_error = EngineDeadError("the interpreter is shutting down")
        if self.dead_error is not None:
            raise self.dead_error
        future: Future[T] = self._thread.submit(fn, *args)
        try:
            return future.result(limit)
        except FutureTimeout:
            if future.done():  # it finished just now: its own outcome
                return future.result()
            raise self._declare_dead(what) from None

    def _declare_dead(self, what: str) -> EngineDeadError:
        where = self.where_stuck()
        message = (
            f"the engine core is stuck: {what}, {where}. The engine was abandoned (its "
            "thread keeps running that code) and is dead; start a new LLM."
        )
        logger.error("%s", message)
        self.dead_error = EngineDeadError(message)
        return self.dead_error

    def where_stuck(self) -> str:
        """Where the engine's threads are stuck: its own thread first, then those started
        since (such as the ``uni`` executor's worker)."""
        engine = self._thread.thread.ident
        own = [t.ident for t in threading.enumerate() if t.ident not in self._foreign]
        return where_stuck(sorted(own, key=lambda i: i != engine), self.host)

    def close(self) -> None:
        """Let the engine thread end once its calls are done (it is abandoned if dead)."""
        self._thread.shutdown(wait=self.dead_error is None)


def where_stuck(threads: list[int | None], host: PluginHost | None = None) -> str:
    """``"in plugin 'x' (...), in Cls.method"`` for the first of ``threads`` running a
    plugin's code (with the component it belongs to and its config key, when ``host``
    has it registered), else the line the first thread is at."""
    frames = sys._current_frames()
    for ident in threads:
        found = running_plugin_call(frames.get(ident or -1))
        if found is not None:
            plugin, module, qualname = found
            component = _component_of(host, module, qualname) if host is not None else None
            return f"in plugin {plugin}, in {qualname}" + (f" ({component})" if component else "")
    frame = frames.get(threads[0] or -1) if threads else None
    if frame is None:
        return "at an unknown place"
    return f"at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _selected_by(kind: str, config_key: str | None) -> str:
    """``", config key scheduler.policy"``: what selected a component of ``kind``."""
    from enginecore.worker_component_errors import SELECTED_BY

    if kind in SELECTED_BY:  # a model: the architecture its checkpoint names
        what, key = SELECTED_BY[kind]
        return f", the {what}'s architecture, config key {key}"
    return f", config key {config_key}" if config_key else ""


def _component_of(host: PluginHost, module: str, qualname: str) -> str | None:
    """``"scheduling policy 'x', config key scheduler.policy"`` for the registered entry
    whose class holds ``qualname`` (a method of it), or None."""
    owner = qualname.rsplit(".", 1)[0]
    for kind in COMPONENT_KINDS:
        registry = host.registry(kind.name)
        for name in registry:
            if registry.entry(name).ref in (f"{module}:{owner}", f"{module}:{qualname}"):
                return f"{kind.label} {name!r}{_selected_by(kind.name, kind.config_key)}"
    # A KV connector's halves are built by its registered factory, not registered.
    cls = getattr(sys.modules.get(module), owner, None)
    halves = (KVConnectorWorker, KVConnectorScheduler)
    if isinstance(cls, type) and issubclass(cls, halves):
        half = "worker" if issubclass(cls, KVConnectorWorker) else "scheduler"
        return f"the {half} half of a KV connector, config key {KINDS['kv_connector'].config_key}"
    return None
