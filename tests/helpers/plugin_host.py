"""A PluginHost holding only the plugins a test registers."""

from __future__ import annotations

from typing import Any

import enginecore
from enginecore.plugins import PluginHost, make_plugin_manager


def bare_host(*plugins: tuple[str, Any]) -> PluginHost:
    """A host with no built-ins and no entry points, plus the given in-process plugins."""
    host = make_plugin_manager(load_entrypoints=False, builtins={})
    for name, plugin in plugins:
        record = host.register_object(plugin, name)
        assert record.loaded, record.error
    return host


def registering(
    hook_name: str, name: str, factory: Any, summary: str = "", override: bool = False
) -> Any:
    """A plugin object whose ``hook_name`` implementation adds one component."""

    def impl(registry):
        registry.add(name, factory, summary=summary, override=override)

    impl.__name__ = hook_name
    plugin = type("Plugin", (), {hook_name: staticmethod(enginecore.hookimpl(impl))})
    return plugin()
