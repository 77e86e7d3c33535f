"""Check a config's component names and plugin settings against the registries, up front.

``enginecore config show``, ``LLM`` and ``AsyncLLM`` (so ``serve`` and ``generate``) run
this before any process starts: every problem is reported at once, each with the names
available and a "did you mean".
"""

from __future__ import annotations

from typing import Any

from enginecore.config import EngineConfig, StructuredOutputConfig
from enginecore.errors import ConfigError, EngineCoreError, UnknownComponentError
from enginecore.plugin_settings import plugin_settings
from enginecore.registry import did_you_mean


def selected_components(config: EngineConfig) -> list[tuple[str, str, str]]:
    """``(kind, config key, name)`` for every component the config names."""
    chosen = [
        ("scheduler", "scheduler.name", config.scheduler.name),
        ("scheduling_policy", "scheduler.policy", config.scheduler.policy),
        ("model_runner", "model.runner", config.model.runner),
    ]
    backend = config.structured_output.backend
    if backend != StructuredOutputConfig().backend:  # the default loads only when used
        chosen.append(("structured_output_backend", "structured_output.backend", backend))
    if config.parallel.executor != "auto":
        chosen.append(("executor", "parallel.executor", config.parallel.executor))
    if config.kv_transfer.connector:
        chosen.append(("kv_connector", "kv_transfer.connector", config.kv_transfer.connector))
    for name in config.observability.stat_loggers:
        chosen.append(("stat_logger", "observability.stat_loggers", name))
    if config.speculative.speculative_method is not None:
        method = config.speculative.speculative_method
        chosen.append(("spec_decode_proposer", "speculative.speculative_method", method))
    for kind, key in (
        ("attention_backend", "attention_backend"),
        ("linear_method", "linear_method"),
    ):
        name = getattr(config.model, key)
        if name != "auto":
            chosen.append((kind, f"model.{key}", name))
    if config.server.tool_call_parser:
        chosen.append(("tool_parser", "server.tool_call_parser", config.server.tool_call_parser))
    if config.server.reasoning_parser:
        name = config.server.reasoning_parser
        chosen.append(("reasoning_parser", "server.reasoning_parser", name))
    return chosen


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
