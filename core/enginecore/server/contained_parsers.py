"""Tool-call and reasoning parsers, each bounded in time and named when it fails.

A parser is plugin code the server runs for every reply (``parse`` on each streamed
delta, ``start`` once). :func:`build_contained_parser` builds one for a request on a
daemon thread of the request's own and replaces its ``parse`` and ``start`` with calls
on that thread bounded by ``engine.frontend_plugin_timeout``
(:mod:`enginecore.frontend_plugin_calls`): a parser that raises or does not return
fails that request alone, with a 500 naming the parser, its plugin, the config key that
selected it and the method; the other requests keep being served. The thread ends with
the parser.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from enginecore.component_kinds import KINDS
from enginecore.engine.serial_thread import SerialThread
from enginecore.errors import EngineCoreError
from enginecore.frontend_plugin_calls import PluginCallTimeout, call_bounded
from enginecore.plugin_attribution import attribute_origin
from enginecore.server.errors import APIError

#: The parser methods the server calls, bounded on each instance.
BOUNDED_METHODS = ("parse", "start")


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
) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is thread.thread:  # a bounded method calling another
            return method(ref(), *args, **kwargs)
        try:
            return call_bounded(thread, method, (ref(), *args), timeout, kwargs)
        except EngineCoreError:  # the parser's own refusal, already meant for the client
            raise
        except Exception as exc:
            raise _failure(described, where, exc) from exc

    return call


def build_contained_parser(
    kind: str, name: str, factory: Callable[..., Any], tokenizer: Any, timeout: float
) -> Any:
    """``factory(tokenizer)`` with its ``parse`` and ``start`` bounded and named."""
    thread = SerialThread(f"enginecore-{kind.replace('_', '-')}-{name}")
    try:
        parser = call_bounded(thread, factory, (tokenizer,), timeout)
    except Exception as exc:
        thread.shutdown(wait=False)
        raise _failure(_describe(kind, name, factory), "building it", exc) from exc
    described = _describe(kind, name, type(parser))
    ref = weakref.ref(parser)
    for method in BOUNDED_METHODS:
        original = getattr(type(parser), method, None)
        if callable(original):
            where = f"in {type(parser).__qualname__}.{method}"
            setattr(parser, method, _bounded(ref, original, where, thread, timeout, described))
    weakref.finalize(parser, thread.shutdown, False)
    return parser
