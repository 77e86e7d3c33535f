"""Errors raised while a plugin's component starts: they name the plugin and the component.

A bug inside a plugin (a ``TypeError`` in its ``__init__``, a missing attribute) would
otherwise surface as a bare traceback from deep in the engine. :func:`build_component`
turns it into one message that says which component, which plugin and distribution,
and what to do; the original exception stays chained as ``__cause__``. Errors that
enginecore itself raised (``EngineCoreError``) already say what is wrong and pass
through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from enginecore.component_kinds import KINDS
from enginecore.errors import EngineCoreError

T = TypeVar("T")


class ComponentStartupError(EngineCoreError):
    """A plugin-provided component raised while it was being built."""

    def __init__(self, message: str, *, kind: str, name: str, plugin: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.plugin = plugin


def describe_provider(host: Any, kind: str, name: str) -> tuple[str, str]:
    """``("scheduling policy 'sjf' from plugin 'sjf' (distribution enginecore-sjf 0.1.0)",
    plugin_name)``."""
    entry = host.registry(kind).entry(name)
    record = host.records.get(entry.plugin)
    origin = record.describe() if record is not None else repr(entry.plugin)
    return f"{kind.replace('_', ' ')} {name!r} from plugin {origin}", entry.plugin


def build_component(
    host: Any, kind: str, name: str, factory: Callable[..., T], *args: Any, **kw: Any
) -> T:
    """``factory(*args, **kw)``; a non-enginecore exception becomes a ComponentStartupError.

    When the providing plugin declares a settings type, the factory also gets
    ``settings=`` (its ``[plugins.NAME]`` table, validated); ``args[0]`` is the config.
    """
    settings_type = getattr(host, "settings_type", None)
    if settings_type is not None and args:
        plugin = host.registry(kind).entry(name).plugin
        declared = settings_type(plugin)
        if declared is not None:
            from enginecore.plugin_settings import plugin_settings

            kw = {**kw, "settings": plugin_settings(args[0], plugin, declared)}
    try:
        return factory(*args, **kw)
    except EngineCoreError:
        raise
    except Exception as exc:
        provider, plugin = describe_provider(host, kind, name)
        key = KINDS[kind].config_key if kind in KINDS else None
        hint = f" Fix the plugin, or select another {kind.replace('_', ' ')}"
        hint += f" (config key {key})." if key else "."
        raise ComponentStartupError(
            f"{provider} failed to start: {type(exc).__name__}: {exc}.{hint}",
            kind=kind,
            name=name,
            plugin=plugin,
        ) from exc
