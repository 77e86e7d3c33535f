"""Choosing the attention backend and the linear method for a model on a device.

``auto`` takes the supporting candidate with the highest ``priority``; a name chosen in
the config must support the model, or start-up fails saying why and which would. Where
``cache.block_size`` is unset each attention backend is judged at the block size it asks
for (``default_block_size``), so ``auto`` can pick one that reads only large pages.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from enginecore.errors import ConfigError
from enginecore.interfaces import AttentionBackend, AttentionSpec, LinearMethod
from enginecore.registry import import_ref


def _classes(refs: dict[str, str]) -> dict[str, Any]:
    return {name: import_ref(ref) for name, ref in refs.items()}


def registered_refs(kind: str) -> dict[str, str]:
    """Name -> ref of every registered ``kind`` in this process: for a runner given no
    refs (one built by hand, outside an engine)."""
    from enginecore.plugins import make_plugin_manager

    registry = make_plugin_manager().registry(kind)
    return {name: registry.entry(name).ref for name in registry}


def select_attention_backend(
    spec: AttentionSpec, refs: dict[str, str], selected: str, *, auto_block_size: bool = False
) -> type[AttentionBackend]:
    """The backend named ``selected`` (or the best for ``spec`` when ``"auto"``). With
    ``auto_block_size`` (``cache.block_size`` unset) each backend is judged at its own
    ``default_block_size``, which the caller then gives it."""
    if selected == "auto":
        classes = _classes(refs)
        specs = {
            name: replace(spec, block_size=cls.default_block_size) if auto_block_size else spec
            for name, cls in classes.items()
        }
        return _best_backend(classes, specs)
    if selected not in refs:
        raise ConfigError(
            f"attention_backend {selected!r} is not registered "
            f"(registered: {', '.join(sorted(refs)) or 'none'})"
        )
    cls: type[AttentionBackend] = import_ref(refs[selected])
    if auto_block_size:
        spec = replace(spec, block_size=cls.default_block_size)
    reason = cls.unsupported_reason(spec, by_name=True)
    if reason is None:
        return cls
    able = [n for n, c in _classes(refs).items() if c.unsupported_reason(spec) is None]
    raise ConfigError(
        f"attention_backend {selected!r} cannot run this model: {reason} "
        f"(backends that can: {', '.join(sorted(able)) or 'none'})"
    )


def _best_backend(
    classes: dict[str, Any], specs: dict[str, AttentionSpec]
) -> type[AttentionBackend]:
    """The supporting backend of highest priority, each judged on its own spec."""
    reasons: dict[str, str] = {}
    best: tuple[int, str, type[AttentionBackend]] | None = None
    for name, cls in classes.items():
        reason = cls.unsupported_reason(specs[name])
        if reason is not None:
            reasons[name] = reason
        elif best is None or cls.priority > best[0]:
            best = (cls.priority, name, cls)
    if best is None:
        detail = "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items()))
        raise ConfigError(f"no attention backend supports this model on this device ({detail})")
    return best[2]


def select_linear_method(
    device: str, dtype: str, refs: dict[str, str], selected: str
) -> type[LinearMethod]:
    """The linear method named ``selected`` (or the best for the device when ``"auto"``)."""
    if selected != "auto":
        if selected not in refs:
            raise ConfigError(
                f"linear_method {selected!r} is not registered "
                f"(registered: {', '.join(sorted(refs)) or 'none'})"
            )
        cls: type[LinearMethod] = import_ref(refs[selected])
        reason = cls.unsupported_reason(device, dtype)
        if reason is not None:
            raise ConfigError(f"linear_method {selected!r} cannot run here: {reason}")
        return cls
    candidates = [
        (cls.priority, name, cls)
        for name, cls in _classes(refs).items()
        if cls.unsupported_reason(device, dtype) is None
    ]
    if not candidates:
        raise ConfigError(f"no linear method supports {dtype} on {device}")
    best_class: type[LinearMethod] = max(candidates, key=lambda c: c[0])[2]
    return best_class
