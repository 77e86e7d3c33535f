"""What ``enginecore plugins`` shows of each attention backend and linear method: what it
supports and its priority, so a user can see which one ``auto`` would take, and why."""

from __future__ import annotations

from enginecore.component_kinds import COMPONENT_KINDS
from enginecore.plugins import PluginHost

DESCRIBED_KINDS = tuple(kind.name for kind in COMPONENT_KINDS if kind.described)


def describe_component(host: PluginHost, kind: str, name: str) -> str:
    try:
        cls = host.registry(kind).get(name)
    except Exception as exc:  # a broken plugin's class: say so, list the rest
        return f"cannot be imported: {exc}"
    if kind == "attention_backend":
        return f"priority {cls.priority}; {cls.capabilities.describe()}"
    return (
        f"priority {cls.priority}; devices {'/'.join(cls.devices)}; dtypes {'/'.join(cls.dtypes)}"
    )
