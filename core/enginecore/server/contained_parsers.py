"""Tool-call and reasoning parsers, each bounded in time and named when it fails.

A parser is plugin code the server runs for every reply (``parse`` on each streamed
delta, ``start`` once). :func:`build_contained_parser` builds one for a request on a
daemon thread of the request's own and replaces its ``parse``, ``start`` and
``extract_reasoning`` (the whole reply's split) with calls on that thread bounded by
``engine.frontend_plugin_timeout`` (:mod:`enginecore.frontend_plugin_calls`): a
parser that raises or does not return fails that request alone, with a 500 (an
``error`` event once a stream has begun) naming the parser, its plugin, the config key
that selected it and the method; the other requests keep being served. The thread ends
with the parser.

The server never waits for a parser on its event loop: every piece of route code that
builds or calls the request's parsers runs through :func:`run_parsing`, on a waiter thread
the event loop awaits, so a parser held up to its limit holds only its own request.

A call past its limit cannot be stopped: its thread stays abandoned until the call
returns. At most :data:`MAX_ABANDONED_CALLS` such calls per parser are kept; while that
many still run, requests that need the parser are refused at once (503, naming it and
how many of its calls are held), so a parser that hangs for good holds a bounded number
of threads. It serves requests again as soon as one of them returns.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from enginecore.component_kinds import KINDS
from enginecore.engine.serial_thread import SerialThread
from enginecore.errors import EngineCoreError
from enginecore.frontend_plugin_calls import TIMEOUT_KEY, PluginCallTimeout, call_bounded
from enginecore.plugin_attribution import attribute_origin
from enginecore.reasoning_parsers.base import ReasoningParser
from enginecore.server.errors import APIError

#: The parser methods the server calls, bounded on each instance.
BOUNDED_METHODS = ("parse", "start", "extract_reasoning")

#: Defaults left unwrapped: they only call ``parse``, which is bounded and named itself.
_DEFAULTS = {ReasoningParser.extract_reasoning}

#: Calls of one parser past their limit that may still hold their threads.
MAX_ABANDONED_CALLS = 4

#: The threads route code waits on parsers from; each waits at most the limit per call.
_WAITERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="enginecore-parser-wait")

_T = TypeVar("_T")


async def run_parsing(uses_parser: bool, fn: Callable[..., _T], /, *args: Any) -> _T:
    """``fn(*args)``: route code that builds or calls the request's parsers, waited for
    off the event loop so a slow or hung parser holds only this request. Without a parser
    (``uses_parser`` False) it runs right here."""
    if not uses_parser:
        return fn(*args)
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_WAITERS, call)


class _AbandonedCalls:
    """How many calls past their limit each parser still runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], int] = {}

    def count(self, key: tuple[str, str]) -> int:
        with self._lock:
            return self._running.get(key, 0)

    def add(self, key: tuple[str, str], future: Future[Any]) -> None:
        with self._lock:
            self._running[key] = self._running.get(key, 0) + 1
        future.add_done_callback(lambda _: self._returned(key))

    def _returned(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._running[key] -= 1


_ABANDONED = _AbandonedCalls()


def _describe(kind: str, name: str, origin: Any) -> str:
    """``"tool parser 'x' from plugin 'p' (distribution d 1.0), config key K"``."""
    plugin = attribute_origin(origin)
    source = f" from {plugin}" if plugin else ""
    return f"{KINDS[kind].label} {name!r}{source}, config key {KINDS[kind].config_key}"


def _failure(described: str, where: str, exc: BaseException) -> APIError:
    if isinstance(exc, PluginCallTimeout):
        what = str(exc)
    else:
        what = f"raised {type(exc).__name__}: {exc}"
    return APIError(500, f"{described}: {where} {what}")


def _bounded(
    ref: weakref.ref[Any],
    method: Callable[..., Any],
    where: str,
    thread: SerialThread,
    timeout: float,
    described: str,
    abandoned: Callable[[Future[Any]], None],
) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is thread.thread:  # a bounded method calling another
            return method(ref(), *args, **kwargs)
        try:
            return call_bounded(thread, method, (ref(), *args), timeout, kwargs, abandoned)
        except EngineCoreError:  # the parser's own refusal, already meant for the client
            raise
        except Exception as exc:
            raise _failure(described, where, exc) from exc

    return call


def build_contained_parser(
    kind: str, name: str, factory: Callable[..., Any], tokenizer: Any, timeout: float
) -> Any:
    """``factory(tokenizer)`` with its ``parse``, ``start`` and ``extract_reasoning``
    bounded and named; refused (503) while :data:`MAX_ABANDONED_CALLS` of the parser's
    calls past their limit run."""
    key = (kind, name)
    held = _ABANDONED.count(key)
    if held >= MAX_ABANDONED_CALLS:
        raise APIError(
            503,
            f"{_describe(kind, name, factory)}: refused while {held} of its calls that did "
            f"not return within the limit (config key {TIMEOUT_KEY}) still run",
        )
    abandoned = functools.partial(_ABANDONED.add, key)
    thread = SerialThread(f"enginecore-{kind.replace('_', '-')}-{name}")
    try:
        parser = call_bounded(thread, factory, (tokenizer,), timeout, None, abandoned)
    except Exception as exc:
        thread.shutdown(wait=False)
        raise _failure(_describe(kind, name, factory), "building it", exc) from exc
    described = _describe(kind, name, type(parser))
    ref = weakref.ref(parser)
    for method in BOUNDED_METHODS:
        original = getattr(type(parser), method, None)
        if callable(original) and original not in _DEFAULTS:
            where = f"in {type(parser).__qualname__}.{method}"
            bounded = _bounded(ref, original, where, thread, timeout, described, abandoned)
            setattr(parser, method, bounded)
    weakref.finalize(parser, thread.shutdown, False)
    return parser
