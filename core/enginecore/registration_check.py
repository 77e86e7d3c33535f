"""What a registered factory must be for its component kind, checked when it is added.

A registration the engine could never use (a plain class registered as a linear method,
an RPC that cannot take the worker) would otherwise fail later, far from the plugin,
and take down things that never selected it: ``auto`` selection reads every candidate's
``priority``. :func:`registration_problem` is what the registry checks when an entry is
added (and when a lazy ``"module:attr"`` entry is imported): the attributes and call
shape the engine relies on, so such an entry is dropped and the plugin host names the
plugin in its warning, in ``enginecore plugins`` and in ``--check``.
:func:`factory_problem` is the stricter check ``enginecore plugins --check`` adds: the
right base class, no abstract method left.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from enginecore.component_kinds import COMPONENT_KINDS

#: Component kind -> the class its entries must subclass.
EXPECTED_BASE: dict[str, type] = {k.name: k.base for k in COMPONENT_KINDS if k.base is not None}

#: Component kind -> how many positional arguments the engine calls its factory with.
CALLED_WITH: dict[str, tuple[int, str]] = {
    k.name: k.called_with for k in COMPONENT_KINDS if k.called_with is not None
}

#: What the engine reads from every registered class of a kind, selected or not.
REQUIRED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    k.name: k.required_attributes for k in COMPONENT_KINDS if k.required_attributes
}


def _call_problem(kind: str, name: str, factory: Any) -> str | None:
    expected = CALLED_WITH.get(kind)
    if expected is None:
        return None
    count, shape = expected
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return None
    # A plugin that declares settings is also given ``settings=``.
    settings = {"settings": None} if "settings" in signature.parameters else {}
    try:
        signature.bind(*([None] * count), **settings)
    except TypeError as exc:
        return (
            f"{kind.replace('_', ' ')} {name!r} cannot be called as {shape}: "
            f"its signature is {signature} ({exc})"
        )
    return None


def registration_problem(kind: str, name: str, factory: Any) -> str | None:
    """What makes ``factory`` unusable as a ``kind`` (checked when registered), or None."""
    label = kind.replace("_", " ")
    required = REQUIRED_ATTRIBUTES.get(kind)
    if required is not None:
        base = EXPECTED_BASE[kind]
        if not inspect.isclass(factory):
            return f"{label} {name!r} is {factory!r}, not a class (subclass {base.__name__})"
        lacking = [a for a in required if not hasattr(factory, a)]
        if lacking:
            return (
                f"{label} {name!r} is {factory!r}, not a subclass of "
                f"enginecore.interfaces.{base.__name__}: it lacks {', '.join(lacking)}"
            )
        if inspect.isabstract(factory):
            missing = ", ".join(sorted(cast(Any, factory).__abstractmethods__))
            return f"{label} {name!r} ({factory.__qualname__}) does not implement {missing}"
        return _call_problem(kind, name, factory)
    if kind == "kv_connector":
        return factory_problem(kind, name, factory)
    selected_base = EXPECTED_BASE.get(kind)
    if selected_base is not None:  # built only when selected, where a failure names it; but an
        # implementation that cannot take the engine's call is refused now (one that is
        # not an implementation at all is named by ``enginecore plugins --check``)
        if inspect.isclass(factory) and issubclass(factory, selected_base):
            return _call_problem(kind, name, factory)
        return None
    if not callable(factory):
        return f"{label} {name!r} is {factory!r}, which is not callable"
    return _call_problem(kind, name, factory)


def factory_problem(kind: str, name: str, factory: Any) -> str | None:
    """What is wrong with ``factory`` as a ``kind`` registered under ``name``, or None."""
    label = kind.replace("_", " ")
    base = EXPECTED_BASE.get(kind)
    if base is not None:
        if not inspect.isclass(factory) or not issubclass(factory, base):
            return (
                f"{label} {name!r} is {factory!r}, not a subclass of "
                f"enginecore.interfaces.{base.__name__}"
            )
        if inspect.isabstract(factory):
            missing = ", ".join(sorted(cast(Any, factory).__abstractmethods__))
            return (
                f"{label} {name!r} ({factory.__qualname__}) does not implement "
                f"the abstract methods {missing} of {base.__name__}"
            )
        return _call_problem(kind, name, factory)
    if kind == "kv_connector":
        lacking = [m for m in ("scheduler_side", "worker_side") if not hasattr(factory, m)]
        if lacking:
            return (
                f"KV connector {name!r} ({factory!r}) lacks {', '.join(lacking)}: its factory "
                "must build the two halves (scheduler_side(config), worker_side(config, rank))"
            )
        return None
    if not callable(factory):
        return f"{label} {name!r} is {factory!r}, which is not callable"
    return _call_problem(kind, name, factory)
