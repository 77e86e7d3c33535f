"""Check a config's component names and plugin settings against the registries, up front.

``enginecore config show``, ``LLM`` and ``AsyncLLM`` (so ``serve`` and ``generate``) run
this before any process starts: every problem is reported at once, each with the names
available and a "did you mean".
"""

from __future__ import annotations

from typing import Any

from enginecore.component_kinds import COMPONENT_KINDS
from enginecore.config import EngineConfig
from enginecore.errors import ConfigError, EngineCoreError, UnknownComponentError
from enginecore.plugin_settings import plugin_settings
from enginecore.registry import did_you_mean


def selected_components(config: EngineConfig) -> list[tuple[str, str, str]]:
    """``(kind, config key, name)`` for every component the config names."""
    return [
        (kind.name, kind.config_key, name)
        for kind in COMPONENT_KINDS
        if kind.selected is not None and kind.config_key is not None
        for name in kind.selected(config)
    ]


def check_components(config: EngineConfig, host: Any) -> None:
    """Raise one :class:`ConfigError` listing every unknown name and bad plugin table."""
    problems: list[str] = []
    for kind, key, name in selected_components(config):
        registry = host.registry(kind)
        if name not in registry:
            problems.append(f"{key}: {registry.unknown_message(name)}")
    unknown_names = bool(problems)
    loaded = [r.name for r in host.records.values() if r.loaded]
    for plugin in config.plugins.config:
        record = host.records.get(plugin)
        if record is None:
            problems.append(
                f"[plugins.{plugin}]: no plugin named {plugin!r} is loaded."
                f"{did_you_mean(plugin, loaded)} Run 'enginecore plugins' for the names."
            )
        elif not record.loaded:
            problems.append(f"[plugins.{plugin}]: plugin {plugin!r} failed to load: {record.error}")
        else:
            declared = host.settings_type(plugin)
            if declared is not None:
                try:
                    plugin_settings(config, plugin, declared)
                except EngineCoreError as exc:
                    problems.append(str(exc))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        error = UnknownComponentError if unknown_names else ConfigError
        raise error(f"the config names components that cannot be used:\n{lines}")
