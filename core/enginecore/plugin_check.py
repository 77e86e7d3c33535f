"""``enginecore plugins --check``: everything that can be verified without an engine.

Loading already validates each plugin (imports, hook names and argument names against
the specs, the declared plugin-API range) and building the registries runs every
registration hook. On top of that this module imports every component a third-party
plugin registered and checks that it is what the engine will expect (the right ABC,
no abstract method left, the right constructor shape), and looks for the quiet
mistakes: a function named like a hook but not decorated with ``@enginecore.hookimpl``,
a plugin that registers nothing, a plugin that declares no plugin-API range. Each
finding names the plugin and its distribution and says what to fix.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, cast

from enginecore.component_kinds import COMPONENT_KINDS
from enginecore.plugins import COMPONENT_HOOKS, LIFECYCLE_HOOKS, PluginHost, PluginRecord

# What each registry's entries must be.
EXPECTED_BASE: dict[str, type] = {k.name: k.base for k in COMPONENT_KINDS if k.base is not None}
ALL_HOOKS = (*COMPONENT_HOOKS.values(), *LIFECYCLE_HOOKS, "plugin_api_versions")


@dataclass
class Finding:
    plugin: str
    origin: str  # "distribution enginecore-x 1.0" or "builtin"
    severity: str  # "error" or "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: plugin {self.plugin!r} ({self.origin}): {self.message}"

    def to_json(self) -> dict[str, str]:
        return {"severity": self.severity, "message": self.message}


def _origin(record: PluginRecord) -> str:
    if record.builtin:
        return "builtin"
    return f"distribution {record.distribution} {record.version}"


def _check_component(kind: str, name: str, obj: Any) -> str | None:
    """What is wrong with a registered factory, or None."""
    base = EXPECTED_BASE.get(kind)
    if base is not None:
        if not inspect.isclass(obj) or not issubclass(obj, base):
            return (
                f"{kind.replace('_', ' ')} {name!r} is {obj!r}, not a subclass of "
                f"enginecore.interfaces.{base.__name__}"
            )
        if inspect.isabstract(obj):
            # inspect.isabstract: the class has __abstractmethods__, which `type` lacks.
            missing = ", ".join(sorted(cast(Any, obj).__abstractmethods__))
            return (
                f"{kind.replace('_', ' ')} {name!r} ({obj.__qualname__}) does not implement "
                f"the abstract methods {missing} of {base.__name__}"
            )
        return None
    if kind == "kv_connector":
        factory = obj
        lacking = [m for m in ("scheduler_side", "worker_side") if not hasattr(factory, m)]
        if lacking:
            return (
                f"KV connector {name!r} ({obj!r}) lacks {', '.join(lacking)}: its factory "
                "must build the two halves (scheduler_side(config), worker_side(config, rank))"
            )
        return None
    if not callable(obj):
        return f"{kind.replace('_', ' ')} {name!r} is {obj!r}, which is not callable"
    return None


def _undecorated_hooks(record: PluginRecord, plugin: Any) -> list[str]:
    """Functions named like (or almost like) a hook that pluggy will never call."""
    found = []
    implemented = set(record.hooks)
    for attr in dir(plugin):
        if attr.startswith("_"):
            continue
        value = getattr(plugin, attr, None)
        if not inspect.isfunction(value) or hasattr(value, "enginecore_impl"):
            continue
        if getattr(value, "__module__", None) != getattr(plugin, "__name__", None):
            continue  # imported helpers
        if attr in ALL_HOOKS and attr not in implemented:
            found.append(
                f"function {attr}() is not decorated with @enginecore.hookimpl, so "
                "enginecore never calls it"
            )
            continue
        close = difflib.get_close_matches(attr, ALL_HOOKS, n=1, cutoff=0.85)
        if close and close[0] not in implemented and attr.startswith(("register", "engine")):
            found.append(
                f"function {attr}() looks like the hook {close[0]}() but is not one "
                "(check the spelling, and decorate it with @enginecore.hookimpl)"
            )
    return found


def _post_mortem(host: PluginHost, record: PluginRecord) -> list[str]:
    """Every other problem of a plugin that failed after import, found without loading it:
    each hook's name and arguments, each registration hook run into a scratch registry,
    each component it would have registered."""
    from enginecore.registry import Registry, providing_plugin

    plugin = record.plugin
    problems = _undecorated_hooks(record, plugin)
    kinds = {hook: kind for kind, hook in COMPONENT_HOOKS.items()}
    for attr in dir(plugin):
        function = getattr(plugin, attr, None)
        if not callable(function) or getattr(function, "enginecore_impl", None) is None:
            continue
        if attr in (record.error or ""):
            continue  # the failure already reported
        caller = getattr(host.pm.hook, attr, None)
        spec = getattr(caller, "spec", None)
        if spec is None:
            problems.append(f"implements unknown hook {attr!r}")
            continue
        argnames = list(inspect.signature(function).parameters)
        extra = [a for a in argnames if a not in spec.argnames]
        if extra:
            problems.append(
                f"{attr}() takes {', '.join(extra)}, which the hook does not pass "
                f"(the spec is {attr}({', '.join(spec.argnames)}))"
            )
            continue
        kind = kinds.get(attr)
        if kind is None:
            continue  # an observer: nothing to run
        scratch: Registry[Any] = Registry(kind=kind.replace("_", " "))
        token = providing_plugin.set(record.name)
        try:
            function(**{a: scratch for a in argnames})
        except Exception as exc:
            problems.append(f"raised in {attr}: {type(exc).__name__}: {exc}")
        finally:
            providing_plugin.reset(token)
        for name in scratch.names():
            try:
                problem = _check_component(kind, name, scratch.get(name))
            except Exception as exc:
                problem = str(exc)
            if problem:
                problems.append(problem)
    return problems


def check_plugins(host: PluginHost) -> list[Finding]:
    """Run every registration hook and every check; returns the findings, errors first."""
    registries = host.all_registries()
    findings: list[Finding] = []
    for record in host.records.values():
        origin = _origin(record)
        if not record.loaded:
            findings.append(Finding(record.name, origin, "error", record.error or "failed"))
            if record.plugin is not None:  # imported: report what else is wrong with it
                for message in _post_mortem(host, record):
                    findings.append(Finding(record.name, origin, "error", message))
            continue
        if record.builtin:
            continue
        plugin = host.pm.get_plugin(record.name)
        for message in _undecorated_hooks(record, plugin):
            findings.append(Finding(record.name, origin, "error", message))
        if record.api_versions is None:
            findings.append(
                Finding(
                    record.name,
                    origin,
                    "warning",
                    "declares no plugin_api_versions(); return a range such as '>=1.0,<2' "
                    "so that an incompatible enginecore refuses it with a clear message",
                )
            )
        if not record.registered and not (set(record.hooks) & set(LIFECYCLE_HOOKS)):
            findings.append(
                Finding(
                    record.name,
                    origin,
                    "warning",
                    "registers no component and observes no lifecycle hook: it does nothing",
                )
            )
        for kind, names in record.registered.items():
            registry = registries[kind]
            for name in names:
                try:
                    obj = registry.get(name)
                except Exception as exc:
                    findings.append(Finding(record.name, origin, "error", str(exc)))
                    continue
                problem = _check_component(kind, name, obj)
                if problem:
                    findings.append(Finding(record.name, origin, "error", problem))
    findings.sort(key=lambda f: (f.severity != "error", f.plugin))
    return findings
