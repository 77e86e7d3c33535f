"""What ``enginecore plugins`` shows of the attention backends and linear methods: what
each supports, so a user can see which one ``auto`` would take, and why."""

from __future__ import annotations

from enginecore.plugins import PluginHost


def describe_backends(host: PluginHost) -> list[str]:
    """One line per attention backend and linear method: name, provider, support."""
    lines = ["attention backends (model.attention_backend; auto = highest priority that fits):"]
    registry = host.registry("attention_backend")
    for name in sorted(registry):
        entry = registry.entry(name)
        try:
            cls = registry.get(name)
            caps = f"priority {cls.priority}; {cls.capabilities.describe()}"
        except Exception as exc:  # a broken plugin's class: say so, list the rest
            caps = f"cannot be imported: {exc}"
        lines.append(f"    {name} (from {entry.plugin}): {caps}")
    lines.append("linear methods (model.linear_method):")
    registry = host.registry("linear_method")
    for name in sorted(registry):
        entry = registry.entry(name)
        try:
            cls = registry.get(name)
            caps = (
                f"priority {cls.priority}; devices {'/'.join(cls.devices)}; "
                f"dtypes {'/'.join(cls.dtypes)}"
            )
        except Exception as exc:
            caps = f"cannot be imported: {exc}"
        lines.append(f"    {name} (from {entry.plugin}): {caps}")
    return lines
