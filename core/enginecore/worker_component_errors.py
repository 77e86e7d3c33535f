"""Start-up failures of the components a worker builds (the attention backend, the
linear method and the worker half of a KV connector), named as the component's, not the
executor's.

The worker holds only ``module:attr`` references, so on failure it looks the plugin up
in a plugin manager built with the engine's plugin selection: the message names the
component kind, its registered name, the plugin and its distribution, and the config
key that selected it. That lookup runs only on the failure path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from enginecore.component_kinds import KINDS
from enginecore.errors import EngineCoreError
from enginecore.interfaces import WorkerSpec
from enginecore.startup_errors import ComponentStartupError

T = TypeVar("T")


def registered_name(cls: type, refs: dict[str, str]) -> str:
    """The name ``cls`` is registered under in ``refs`` (its qualified name otherwise)."""
    ref = f"{cls.__module__}:{cls.__qualname__}"
    return next((name for name, r in refs.items() if r == ref), ref)


def _provider(kind: str, name: str, spec: WorkerSpec | None) -> tuple[str, str]:
    """``("attention backend 'x' from plugin 'p' (distribution d 1.0)", "p")``."""
    from enginecore.plugins import make_plugin_manager
    from enginecore.startup_errors import describe_provider

    label = f"{kind.replace('_', ' ')} {name!r}"
    try:
        enabled = spec.enabled_plugins if spec is not None else None
        disabled = spec.disabled_plugins if spec is not None else []
        return describe_provider(make_plugin_manager(enabled, disabled), kind, name)
    except Exception:  # the lookup must never hide the component's own error
        return label, "?"


def build_worker_component(
    kind: str,
    cls: Callable[..., T],
    refs: dict[str, str],
    spec: WorkerSpec | None,
    *args: Any,
    name: str | None = None,
) -> T:
    """``cls(*args)``; what it raises (other than an enginecore error) is reported as the
    component's start-up failure, with the original chained as ``__cause__``. ``name``:
    the registered name, where ``cls`` is not the registered class itself."""
    try:
        return cls(*args)
    except EngineCoreError:
        raise
    except Exception as exc:
        if name is None:
            name = registered_name(cls, refs) if isinstance(cls, type) else repr(cls)
        raise worker_component_error(kind, name, spec, exc) from exc


#: What selects a component of a kind that no config key names by its registered name.
SELECTED_BY = {"model": ("checkpoint", "model.path")}


def worker_component_error(
    kind: str, name: str, spec: WorkerSpec | None, exc: Exception
) -> ComponentStartupError:
    """The start-up failure of the ``kind`` registered as ``name``, which raised ``exc``."""
    provider, plugin = _provider(kind, name, spec)
    what, key = SELECTED_BY.get(kind, (kind.replace("_", " "), KINDS[kind].config_key))
    return ComponentStartupError(
        f"{provider} failed to start: {type(exc).__name__}: {exc}. Fix the plugin, or "
        f"select another {what} (config key {key}).",
        kind=kind,
        name=name,
        plugin=plugin,
    )
