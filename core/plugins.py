"""The plugin manager: loads built-ins and entry points, builds registries, calls hooks.

There is no global plugin manager. :func:`make_plugin_manager` builds a :class:`PluginHost`
that the engine passes explicitly; everything in the core calls hooks through the
host's typed methods, never through ``pm.hook.x(...)`` directly.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata
import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from enginecore import hookspecs
from enginecore.errors import IncompatiblePluginError, PluginLoadError
from enginecore.registry import Registry
from enginecore.version import PLUGIN_API_VERSION

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "enginecore"

# Built-in plugins, registered through the same path as third-party ones.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "enginecore.builtin_schedulers.plugin",
    "enginecore.builtin_executors.plugin",
    "enginecore.builtin_models.plugin",
    "enginecore.builtin_attention.plugin",
    "enginecore.builtin_cpu.plugin",
    "enginecore.builtin_kv_connectors.plugin",
    "enginecore.builtin_structured_output.plugin",
    "enginecore.metrics.plugin",
    "enginecore.tool_parsers.plugin",
)

# Component kind -> the hook that fills its registry.
COMPONENT_HOOKS: dict[str, str] = {
    "scheduler": "register_schedulers",
    "scheduling_policy": "register_scheduling_policies",
    "executor": "register_executors",
    "model_runner": "register_model_runners",
    "model": "register_models",
    "attention_backend": "register_attention_backends",
    "linear_method": "register_linear_methods",
    "kv_connector": "register_kv_connectors",
    "stat_logger": "register_stat_loggers",
    "worker_rpc": "register_worker_rpcs",
    "structured_output_backend": "register_structured_output_backends",
    "spec_decode_proposer": "register_spec_decode_proposers",
    "tool_parser": "register_tool_parsers",
}

LIFECYCLE_HOOKS = ("engine_started", "worker_started", "request_finished", "engine_stopped")


def _env_list(name: str) -> list[str] | None:
    """A comma-separated env var: None when unset, [] when set to an empty string."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class PluginRecord:
    """What is known about one plugin, loaded or not (shown by ``enginecore plugins``)."""

    name: str
    module: str
    distribution: str = "builtin"
    version: str = "builtin"
    builtin: bool = False
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)
    api_versions: str | None = None
    error: str | None = None  # one-line summary
    traceback: str | None = None

    @property
    def loaded(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        origin = (
            "builtin"
            if self.builtin
            else f"distribution {self.distribution} {self.version}".strip()
        )
        return f"{self.name!r} ({origin})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "hooks": self.hooks,
            "registered": self.registered,
            "api_versions": self.api_versions,
            "error": self.error,
            "traceback": self.traceback,
        }


@dataclass
class PluginSelection:
    """Which plugins may load: the config's ``plugins`` section merged with the env vars."""

    enabled: list[str] | None = None  # None: every installed plugin; []: none
    disabled: list[str] = field(default_factory=list)
    strict: bool = False
    trace: bool = False

    @classmethod
    def from_env(
        cls, enabled: list[str] | None = None, disabled: Iterable[str] = ()
    ) -> PluginSelection:
        env_enabled = _env_list("ENGINECORE_PLUGINS")
        return cls(
            enabled=env_enabled if env_enabled is not None else enabled,
            disabled=[*disabled, *(_env_list("ENGINECORE_DISABLE_PLUGINS") or [])],
            strict=_env_flag("ENGINECORE_STRICT_PLUGINS"),
            trace=_env_flag("ENGINECORE_TRACE_PLUGINS"),
        )

    def allows(self, *names: str, builtin: bool = False) -> bool:
        if any(n in self.disabled for n in names):
            return False
        if builtin or self.enabled is None:
            return True
        return any(n in self.enabled for n in names)


class PluginHost:
    """The typed facade over one pluggy manager (tox's ``Plugin`` class is the model).

    Build it with :func:`make_plugin_manager`. Registries are built lazily, once per
    kind, the first time something asks for them.
    """

    def __init__(self, selection: PluginSelection | None = None) -> None:
        self.selection = selection or PluginSelection()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._registries: dict[str, Registry] = {}
        if self.selection.trace:
            self.pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[enginecore] {msg}"))
            self.pm.enable_tracing()

    # --- loading ------------------------------------------------------------------------

    def load_builtins(self, modules: Iterable[str] = BUILTIN_PLUGINS) -> None:
        for module_name in modules:
            short = module_name.removeprefix("enginecore.").removesuffix(".plugin")
            if not self.selection.allows(short, module_name, builtin=True):
                continue
            record = PluginRecord(name=short, module=module_name, builtin=True)
            self._load(record, lambda m=module_name: __import__(m, fromlist=["_"]))

    def load_entrypoints(self) -> None:
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            record = PluginRecord(
                name=ep.name,
                module=ep.value,
                distribution=dist.name if dist else "unknown",
                version=dist.version if dist else "unknown",
            )
            if record.name in self.records:
                logger.warning(
                    "two installed distributions declare enginecore plugin %r; keeping %s",
                    record.name,
                    self.records[record.name].describe(),
                )
                continue
            if not self.selection.allows(record.name, record.distribution):
                continue
            self._load(record, ep.load)

    def register_object(self, plugin: Any, name: str) -> PluginRecord:
        """Register an in-process plugin object (tests, notebooks, one-off experiments)."""
        record = PluginRecord(
            name=name,
            module=getattr(plugin, "__name__", type(plugin).__name__),
            distribution="<object>",
            version="",
        )
        self._load(record, lambda: plugin)
        self._registries.clear()  # rebuilt with the new plugin on next use
        return record

    def _load(self, record: PluginRecord, load: Any) -> None:
        self.records[record.name] = record
        try:
            plugin = load()
            self.pm.register(plugin, name=record.name)
        except pluggy.PluginValidationError as exc:
            self._fail(record, self._describe_bad_hookimpl(record, exc), exc)
            return
        except Exception as exc:
            self._fail(record, f"failed to load: {type(exc).__name__}: {exc}", exc)
            return
        try:
            self._validate(record, plugin)
        except Exception as exc:
            self.pm.unregister(name=record.name)
            self._fail(record, str(exc), exc)
            return
        record.hooks = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or [])

    def _describe_bad_hookimpl(
        self, record: PluginRecord, exc: pluggy.PluginValidationError
    ) -> str:
        """pluggy's multi-line text as one line that shows the spec's signature."""
        text = " ".join(str(exc).split())
        match = re.search(r"for hook '(\w+)'", text)
        spec = getattr(getattr(self.pm.hook, match.group(1), None), "spec", None) if match else None
        if spec is None:
            return f"failed to load: PluginValidationError: {text}"
        signature = f"{spec.name}({', '.join(spec.argnames)})"
        detail = text.split("hookimpl definition: ", 1)[-1]
        return (
            f"failed to load: plugin {record.name!r} has an invalid hook implementation "
            f"{detail}. The spec is {signature}; "
            "an implementation may take any subset of its arguments, and no others"
        )

    def _validate(self, record: PluginRecord, plugin: Any) -> None:
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                known = ", ".join(sorted(COMPONENT_HOOKS.values()) + list(LIFECYCLE_HOOKS))
                raise PluginLoadError(
                    f"plugin {record.describe()} implements unknown hook {caller.name!r}. "
                    f"Check the spelling; the hooks are: {known}, plugin_api_versions."
                )
        impl = getattr(plugin, "plugin_api_versions", None)
        if impl is None:
            return
        # The hook (a function), or a plain string attribute of the plugin module/object.
        declared = impl() if callable(impl) else impl
        record.api_versions = declared
        if declared is None:
            return
        try:
            spec = SpecifierSet(declared)
        except InvalidSpecifier as exc:
            raise IncompatiblePluginError(
                f"plugin {record.describe()} declares plugin_api_versions() = {declared!r}, "
                f"which is not a version specifier such as '>=1.0,<2'"
            ) from exc
        if Version(PLUGIN_API_VERSION) not in spec:
            raise IncompatiblePluginError(
                f"plugin {record.describe()} supports plugin API {declared}, but this "
                f"enginecore provides plugin API {PLUGIN_API_VERSION}. Upgrade the plugin "
                f"or install an enginecore whose PLUGIN_API_VERSION is in {declared}."
            )

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        record.error = message
        record.traceback = "".join(traceback.format_exception(exc))
        text = f"enginecore plugin {record.describe()} {message}"
        if self.selection.strict:
            raise PluginLoadError(
                f"{text}\n(strict mode: ENGINECORE_STRICT_PLUGINS=1)\n"
                f"Original traceback:\n{record.traceback}"
            ) from exc
        logger.warning("%s. It is skipped; 'enginecore plugins' shows the traceback.", text)

    def _trace(self, message: str) -> None:
        # The host calls each hookimpl itself (to bind provenance and isolate failures),
        # bypassing pluggy's hook-call monitoring, so it traces those calls here.
        if self.selection.trace:
            sys.stderr.write(f"[enginecore] {message}\n")

    # --- registries ---------------------------------------------------------------------

    @property
    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if not r.loaded]

    def registry(self, kind: str) -> Registry:
        """The registry of one component kind (see :data:`COMPONENT_HOOKS`), built once."""
        registry = self._registries.get(kind)
        if registry is None:
            registry = self._build_registry(kind)
            self._registries[kind] = registry
        return registry

    def _build_registry(self, kind: str) -> Registry:
        hook_name = COMPONENT_HOOKS[kind]
        registry: Registry = Registry(kind=kind.replace("_", " "))
        # get_hookimpls() lists trylast (built-in) impls first: built-ins register before
        # third parties, so a plugin's override=True replaces a built-in, never the reverse.
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            record = self.records.get(impl.plugin_name)
            if record is None or not record.loaded:
                continue
            registry._current_plugin = impl.plugin_name
            before = set(registry.entries)
            self._trace(f"{hook_name}(registry) -> plugin {impl.plugin_name!r}")
            try:
                impl.function(**{arg: registry for arg in impl.argnames})
            except Exception as exc:
                self._trace(f"{hook_name}: plugin {impl.plugin_name!r} raised {exc!r}")
                self._fail(record, f"raised in {hook_name}: {type(exc).__name__}: {exc}", exc)
                for name in set(registry.entries) - before:
                    del registry.entries[name]
                continue
            added = [n for n, e in registry.entries.items() if e.plugin == impl.plugin_name]
            self._trace(f"{hook_name}: plugin {impl.plugin_name!r} added {sorted(added)}")
            if added:
                record.registered[kind] = sorted(added)
        registry._current_plugin = "<direct>"
        registry.failed_plugins = [f"{r.describe()}: {r.error}" for r in self.failed]
        return registry

    def all_registries(self) -> dict[str, Registry]:
        return {kind: self.registry(kind) for kind in COMPONENT_HOOKS}

    # --- typed lifecycle calls ----------------------------------------------------------

    def engine_started(self, config: Any, info: dict[str, Any]) -> None:
        self._notify("engine_started", config=config, info=info)

    def worker_started(self, worker: Any) -> None:
        self._notify("worker_started", worker=worker)

    def request_finished(self, request_stats: Any) -> None:
        self._notify("request_finished", request_stats=request_stats)

    def engine_stopped(self, reason: str) -> None:
        self._notify("engine_stopped", reason=reason)

    def has_impls(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def _notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call each observer on its own, so one failing plugin never silences the others."""
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            self._trace(f"{hook_name}({', '.join(impl.argnames)}) -> plugin {impl.plugin_name!r}")
            try:
                impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            except Exception:
                logger.exception("plugin %r raised in %s (ignored)", impl.plugin_name, hook_name)


def make_plugin_manager(
    enabled: list[str] | None = None,
    disabled: Iterable[str] = (),
    *,
    load_entrypoints: bool = True,
    builtins: Iterable[str] = BUILTIN_PLUGINS,
) -> PluginHost:
    """Build a :class:`PluginHost`: built-ins first, then each entry point on its own.

    ``enabled``/``disabled`` come from the config's ``plugins`` section; the env vars
    ``ENGINECORE_PLUGINS`` (allow-list; empty means none), ``ENGINECORE_DISABLE_PLUGINS``,
    ``ENGINECORE_STRICT_PLUGINS`` and ``ENGINECORE_TRACE_PLUGINS`` take precedence.
    """
    host = PluginHost(PluginSelection.from_env(enabled, disabled))
    host.load_builtins(builtins)
    if load_entrypoints:
        host.load_entrypoints()
    return host
