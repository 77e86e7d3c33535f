"""Which installed plugin a run-time error came from, and in which of its methods.

An exception raised from plugin code (an attention forward, a linear ``apply``, a
policy's ``sort_key``, a KV connector, a worker RPC) reaches the user as the engine's
death or a failed call; this names the plugin so the user knows whom to ask. The
plugin is found from the code itself: the innermost traceback frame (or the
``origin`` a contract check names) whose top-level package belongs to a distribution
that declares an ``enginecore`` entry point. Built-in components and enginecore's own
code are not attributed. It needs no plugin manager, so workers use it too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

import importlib_metadata

from enginecore.plugins import ENTRY_POINT_GROUP, is_builtin


@functools.lru_cache(maxsize=1)
def _plugin_packages() -> dict[str, str]:
    """Top-level package -> ``"'plugin' (distribution NAME VERSION)"`` for every
    installed distribution that declares an enginecore plugin."""
    packages: dict[str, str] = {}
    by_dist = importlib_metadata.packages_distributions()
    plugins: dict[str, str] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is not None and not is_builtin(ep.name):
            plugins.setdefault(
                ep.dist.name.lower(), f"{ep.name!r} (distribution {ep.dist.name} {ep.dist.version})"
            )
    for package, dists in by_dist.items():
        for dist in dists:
            described = plugins.get(dist.lower())
            if described is not None:
                packages[package] = described
    return packages


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _frames(tb: TracebackType | None) -> list[tuple[str, str]]:
    """``(module, qualified function name)`` of each frame, outermost first."""
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        frames.append((module, getattr(code, "co_qualname", code.co_name)))
        tb = tb.tb_next
    return frames


def attribute_origin(origin: Any) -> str | None:
    """``"plugin 'x' (distribution d 1.0)"`` for a function or class of an installed
    plugin, or None."""
    module = str(getattr(origin, "__module__", "")).split(".")[0]
    plugin = _plugin_packages().get(module)
    return f"plugin {plugin}" if plugin is not None else None


def attribute(exc: BaseException) -> str | None:
    """``"plugin 'x' (distribution d 1.0), in Cls.method"``, or None when no installed
    plugin's code raised it."""
    packages = _plugin_packages()
    if not packages:
        return None
    for error in _chain(exc):
        origin: Any = getattr(error, "origin", None)
        if origin is not None:
            plugin = packages.get(str(getattr(origin, "__module__", "")).split(".")[0])
            if plugin is not None:
                return f"plugin {plugin}, in {getattr(origin, '__qualname__', origin)}"
        where = _innermost_plugin_call(_frames(error.__traceback__), packages)
        if where is not None:
            return where
    return None


def _way_in(frames: list[tuple[str, str]], packages: dict[str, str]) -> tuple[str, str, str] | None:
    """``(plugin, module, qualified name)`` of the innermost run of one plugin's frames
    (``frames`` outermost first), named by the way in: the run's outermost frame."""
    for index in range(len(frames) - 1, -1, -1):
        plugin = packages.get(frames[index][0].split(".")[0])
        if plugin is None:
            continue
        first = index
        while first > 0 and packages.get(frames[first - 1][0].split(".")[0]) == plugin:
            first -= 1
        return plugin, frames[first][0], frames[first][1]
    return None


def _innermost_plugin_call(frames: list[tuple[str, str]], packages: dict[str, str]) -> str | None:
    """``"plugin 'x' (...), in Cls.method"`` (see :func:`_way_in`)."""
    found = _way_in(frames, packages)
    return f"plugin {found[0]}, in {found[2]}" if found is not None else None


def running_plugin_call(frame: FrameType | None) -> tuple[str, str, str] | None:
    """For a thread that is still running (``frame``: its innermost frame, from
    ``sys._current_frames()``): ``(plugin described, module, qualified name)`` of the
    plugin code it is in, or None when no plugin's code is on its stack."""
    packages = _plugin_packages()
    frames = []
    while frame is not None:
        code = frame.f_code
        module = str(frame.f_globals.get("__name__", ""))
        frames.append((module, getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return _way_in(frames[::-1], packages) if packages else None


def with_attribution(exc: BaseException, text: str) -> str:
    """``text`` followed by `` [raised by plugin ..., in ...]`` when a plugin raised it."""
    where = attribute(exc)
    if not where or f"[raised by {where}]" in text:  # none, or named where it was raised
        return text
    return f"{text} [raised by {where}]"
