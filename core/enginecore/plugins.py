"""The plugin manager: loads built-ins and entry points, builds registries, calls hooks.

There is no global plugin manager. :func:`make_plugin_manager` builds a :class:`PluginHost`
that the engine passes explicitly; everything in the core calls hooks through the
host's typed methods, never through ``pm.hook.x(...)`` directly.

Hooks are called through pluggy, so ``wrapper=True`` and ``hookwrapper=True``
implementations wrap the others as pluggy documents. Each implementation is bound to its
plugin when the plugin registers: a ``Registry.add`` it makes is recorded as that
plugin's, and what it raises is blamed on it. Loading is all-or-nothing per plugin: a
plugin that fails anywhere (import, validation, any registration hook) is unregistered
and every registry is rebuilt without it, so it contributes nothing in any process.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata
import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from enginecore import hookspecs
from enginecore.component_kinds import COMPONENT_KINDS
from enginecore.errors import IncompatiblePluginError, PluginLoadError
from enginecore.registry import Registry, did_you_mean, providing_plugin
from enginecore.version import PLUGIN_API_VERSION

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "enginecore"

#: Entry-point names that mark enginecore's own plugins: each ``builtin_<kind>/`` is a
#: distribution declaring ``builtin_<kind> = "enginecore_<kind>.plugin"`` in this group.
#: They load first and the allow-list does not apply to them.
BUILTIN_PREFIX = "builtin_"
#: The order built-ins load in (others found follow, by name). Load order breaks ties:
#: ``auto`` takes the first of equal-priority candidates (``unquantized`` before ``gguf``).
BUILTIN_LOAD_ORDER = (
    "builtin_schedulers",
    "builtin_executors",
    "builtin_models",
    "builtin_attention",
    "builtin_cpu",
    "builtin_gpu",
    "builtin_kv_connectors",
    "builtin_structured_output",
    "builtin_stat_loggers",
    "builtin_tool_parsers",
    "builtin_reasoning_parsers",
)


def is_builtin(entry_point_name: str) -> bool:
    return entry_point_name.startswith(BUILTIN_PREFIX)


@functools.cache
def builtin_plugins() -> dict[str, str]:
    """The installed built-in plugins, found through their entry points: name -> module."""
    found = {
        ep.name: ep.value
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
        if is_builtin(ep.name)
    }
    if not found:
        logger.error(
            "no built-in enginecore plugins are installed (no %r entry point starts "
            "with %r): reinstall enginecore with its builtin_* distributions (make install)",
            ENTRY_POINT_GROUP,
            BUILTIN_PREFIX,
        )
    rank = {name: i for i, name in enumerate(BUILTIN_LOAD_ORDER)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


# Component kind -> the hook that fills its registry.
COMPONENT_HOOKS: dict[str, str] = {kind.name: kind.hook for kind in COMPONENT_KINDS}

LIFECYCLE_HOOKS = ("engine_started", "worker_started", "request_finished", "engine_stopped")


def _env_list(name: str) -> list[str] | None:
    """A comma-separated env var: None when unset, [] when set to an empty string."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


#: Plugins whose failure this process tree has already warned about. Child processes
#: (engine core, workers) inherit it, so a failure is warned once, not once per process.
WARNED_ENV_VAR = "ENGINECORE_WARNED_PLUGINS"
#: Longest exception text kept in a plugin's one-line error (the traceback has it all).
MAX_ERROR_TEXT = 240


def exception_line(exc: BaseException) -> str:
    """``"ValueError: text"`` on one line, cut to :data:`MAX_ERROR_TEXT` characters."""
    text = " ".join(str(exc).split())
    if isinstance(exc, SystemExit):
        text = f"{text or 0} (the plugin called sys.exit())"
    if len(text) > MAX_ERROR_TEXT:
        text = text[: MAX_ERROR_TEXT - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    # Entries dropped when registered ("linear_method 'x'" -> what is wrong with it):
    # the plugin loaded, these contribute nothing.
    rejected: dict[str, str] = field(default_factory=dict)
    # The imported module/object, kept when a later step failed (``--check`` reports
    # everything else wrong with it too).
    plugin: Any = field(default=None, repr=False, compare=False)

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
            "rejected": self.rejected,
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
        self._registries: dict[str, Registry[Any]] = {}
        self._blamed: list[tuple[BaseException, str]] = []
        self._builtin_names: set[str] = set()
        if self.selection.trace:
            self.pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[enginecore] {msg}"))
            self.pm.enable_tracing()

    # --- loading ------------------------------------------------------------------------

    def load_builtins(self, modules: Mapping[str, str] | None = None) -> None:
        """The built-ins (all installed ones, or ``modules``: name -> module) first."""
        modules = builtin_plugins() if modules is None else modules
        self._builtin_names = {*modules, *modules.values()}
        for short, module_name in modules.items():
            if not self.selection.allows(short, module_name, builtin=True):
                continue
            record = PluginRecord(name=short, module=module_name, builtin=True)
            self._load(record, lambda m=module_name: __import__(m, fromlist=["_"]))

    def load_entrypoints(self) -> None:
        installed: list[str] = []
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            if is_builtin(ep.name):
                continue  # load_builtins' (a subset may have been asked for)
            dist = ep.dist
            installed += [ep.name, dist.name if dist else ep.name]
            record = PluginRecord(
                name=ep.name,
                module=ep.value,
                distribution=dist.name if dist else "unknown",
                version=dist.version if dist else "unknown",
            )
            if record.name in self.records:
                logger.warning(
                    "two installed distributions declare enginecore plugin %r: keeping %s, "
                    "ignoring distribution %s %s. Uninstall one of them.",
                    record.name,
                    self.records[record.name].describe(),
                    record.distribution,
                    record.version,
                )
                continue
            if not self.selection.allows(record.name, record.distribution):
                continue
            self._load(record, ep.load)
        self._warn_unknown_selection(installed)

    def _warn_unknown_selection(self, installed: list[str]) -> None:
        """A name in the allow-list that matches no installed plugin is almost a typo."""
        builtins = [r.name for r in self.records.values() if r.builtin]
        known = {*installed, *builtins, *self._builtin_names}
        for name in dict.fromkeys(self.selection.disabled):
            if name not in known:
                logger.warning(
                    "ENGINECORE_DISABLE_PLUGINS / plugins.disabled names %r, which no "
                    "installed plugin or distribution is called, so it disables nothing.%s "
                    "Installed: %s.",
                    name,
                    did_you_mean(name, known),
                    ", ".join(sorted(n for n in known if "." not in n)) or "none",
                )
        for name in self.selection.enabled or []:
            if name not in installed and name not in builtins:
                logger.warning(
                    "ENGINECORE_PLUGINS / plugins.enabled names %r, which no installed "
                    "plugin or distribution is called.%s Installed: %s.",
                    name,
                    did_you_mean(name, installed),
                    ", ".join(sorted(set(installed))) or "none",
                )

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
        self._registries.clear()
        try:
            plugin = load()
        except BaseException as exc:  # SystemExit and KeyboardInterrupt at import too
            self._fail(record, f"failed to load: {exception_line(exc)}", exc)
            return
        record.plugin = plugin
        try:
            self.pm.register(plugin, name=record.name)
        except pluggy.PluginValidationError as exc:
            self._fail(record, self._describe_bad_hookimpl(exc), exc)
            return
        except BaseException as exc:
            self._fail(record, f"failed to load: {exception_line(exc)}", exc)
            return
        try:
            self._validate(record, plugin)
        except BaseException as exc:
            self._fail(
                record,
                exception_line(exc) if not isinstance(exc, PluginLoadError) else str(exc),
                exc,
            )
            return
        record.hooks = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or [])
        self._bind(plugin, record.name)

    def _bind(self, plugin: Any, name: str) -> None:
        """Wrap each of the plugin's implementations so that it runs as ``name``."""
        for caller in self.pm.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                function = impl.function
                if self.selection.trace:
                    function = _traced(function, name, caller.name)
                if impl.wrapper or impl.hookwrapper:
                    function = _bound_wrapper(function, name, self._blame)
                elif caller.name in LIFECYCLE_HOOKS:
                    function = _bound_observer(function, name, caller.name)
                else:
                    function = _bound_call(function, name, self._blame)
                # pluggy declares HookImpl.function Final; rebinding it is how every call
                # of the plugin's hooks learns the plugin's name.
                impl.function = function  # type: ignore[misc]

    def _blame(self, exc: BaseException, plugin: str) -> None:
        """Remember the first plugin ``exc`` passed through (the one that raised it)."""
        if not any(seen is exc for seen, _ in self._blamed):
            self._blamed.append((exc, plugin))

    def _culprit(self, exc: BaseException) -> str | None:
        named = getattr(exc, "plugin", None)  # a duplicate name: the plugin loaded later
        if isinstance(named, str) and named in self.records:
            return named
        for seen, plugin in self._blamed:
            if seen is exc:
                return plugin
        return None

    def _describe_bad_hookimpl(self, exc: pluggy.PluginValidationError) -> str:
        """pluggy's multi-line text as one line that shows the spec's signature."""
        text = " ".join(str(exc).split())
        match = re.search(r"for hook '(\w+)'", text)
        spec = getattr(getattr(self.pm.hook, match.group(1), None), "spec", None) if match else None
        if spec is None:
            return f"failed to load: PluginValidationError: {text}"
        signature = f"{spec.name}({', '.join(spec.argnames)})"
        detail = text.split("hookimpl definition: ", 1)[-1]
        return (
            f"failed to load: invalid hook implementation {detail}. The spec is {signature}; "
            "an implementation may take any subset of its arguments, and no others"
        )

    def _validate(self, record: PluginRecord, plugin: Any) -> None:
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                known = [*COMPONENT_HOOKS.values(), *LIFECYCLE_HOOKS, "plugin_api_versions"]
                hint = did_you_mean(caller.name, known) or (
                    f" The hooks are: {', '.join(sorted(known))}."
                )
                raise PluginLoadError(f"implements unknown hook {caller.name!r}.{hint}")
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
                f"declares plugin_api_versions() = {declared!r}, "
                f"which is not a version specifier such as '>=1.0,<2'"
            ) from exc
        if Version(PLUGIN_API_VERSION) not in spec:
            raise IncompatiblePluginError(
                f"supports plugin API {declared}, but this "
                f"enginecore provides plugin API {PLUGIN_API_VERSION}. Upgrade the plugin "
                f"or install an enginecore whose PLUGIN_API_VERSION is in {declared}."
            )

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        """Record the failure and take the plugin out: it contributes nothing from now on."""
        record.error = message
        record.traceback = "".join(traceback.format_exception(exc))
        record.registered = {}
        if self.pm.get_plugin(record.name) is not None:
            self.pm.unregister(name=record.name)
        self._registries.clear()
        text = f"enginecore plugin {record.describe()} {message}"
        if self.selection.strict:
            raise PluginLoadError(f"{text} (strict mode: ENGINECORE_STRICT_PLUGINS=1)") from exc
        warned = set(_env_list(WARNED_ENV_VAR) or [])
        if record.name in warned:  # a parent process already said so
            logger.debug("%s; skipped", text)
            return
        text = text if text.endswith((".", "?")) else f"{text}."
        logger.warning("%s It is skipped; 'enginecore plugins -v' shows the traceback.", text)
        os.environ[WARNED_ENV_VAR] = ",".join(sorted(warned | {record.name}))

    # --- registries ---------------------------------------------------------------------

    @property
    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if not r.loaded]

    def registry(self, kind: str) -> Registry[Any]:
        """The registry of one component kind (see :data:`COMPONENT_HOOKS`), built once."""
        registry = self._registries.get(kind)
        if registry is None:
            registry = self._build_registry(kind)
            self._registries[kind] = registry
        return registry

    def _build_registry(self, kind: str) -> Registry[Any]:
        self._build_all()
        return self._registries[kind]

    def _build_all(self) -> None:
        """Run every registration hook; a plugin that raises in one is dropped from all.

        Each failure rebuilds every registry without the failed plugin, so what a plugin
        registered in a hook that ran before it failed never survives.
        """
        load_order = {name: i for i, name in enumerate(self.records)}
        while True:
            registries: dict[str, Registry[Any]] = {
                kind: Registry(kind=kind.replace("_", " "), load_order=load_order)
                for kind in COMPONENT_HOOKS
            }
            failure = None
            for kind, hook_name in COMPONENT_HOOKS.items():
                self._blamed = []
                try:
                    getattr(self.pm.hook, hook_name)(registry=registries[kind])
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:
                    culprit = self._culprit(exc)
                    if culprit is None:
                        raise
                    failure = (culprit, hook_name, exc)
                    break
                finally:
                    self._blamed = []
            if failure is None:
                break
            culprit, hook_name, error = failure
            self._fail(
                self.records[culprit], f"raised in {hook_name}: {exception_line(error)}", error
            )
        for record in self.records.values():
            record.registered = {}
        for kind, registry in registries.items():
            for name, entry in registry.entries.items():
                owner = self.records.get(entry.plugin)
                if owner is not None:
                    owner.registered.setdefault(kind, []).append(name)
            registry.failed_plugins = [r.describe() for r in self.failed]
        for record in self.records.values():
            record.registered = {k: sorted(v) for k, v in record.registered.items()}
        self._registries = registries
        self._report_rejected(registries)

    def _report_rejected(self, registries: dict[str, Registry[Any]]) -> None:
        """Name each dropped registration against its plugin, warned once per process tree."""
        from enginecore.rejected_entries import report_rejected

        report_rejected(self.records, registries)

    def all_registries(self) -> dict[str, Registry[Any]]:
        return {kind: self.registry(kind) for kind in COMPONENT_HOOKS}

    def settings_type(self, plugin_name: str) -> type | None:
        """The msgspec type a loaded plugin declares as ``plugin_settings``, if any."""
        plugin = self.pm.get_plugin(plugin_name)
        declared = getattr(plugin, "plugin_settings", None)
        if isinstance(declared, str):
            from enginecore.registry import import_ref

            declared = import_ref(declared)
        return declared if isinstance(declared, type) else None

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
        """Call the observers through pluggy; each one's failure is logged, never raised."""
        hook = getattr(self.pm.hook, hook_name)
        if not hook.get_hookimpls():
            return
        self._blamed = []
        try:
            hook(**kwargs)
        except Exception as exc:  # a wrapper raised: the observers it wrapped have run
            logger.exception(
                "plugin %r raised in %s (ignored)", self._culprit(exc) or "?", hook_name
            )
        finally:
            self._blamed = []


def _traced(fn: Any, plugin: str, hook_name: str) -> Any:
    """One stderr line per implementation called (ENGINECORE_TRACE_PLUGINS=1)."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        sys.stderr.write(f"[enginecore] {hook_name}() -> plugin {plugin!r}\n")
        return fn(*args)

    return call


def _bound_call(fn: Any, plugin: str, blame: Any) -> Any:
    """A registration implementation that records its entries and failures as ``plugin``."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        token = providing_plugin.set(plugin)
        try:
            return fn(*args)
        except BaseException as exc:
            blame(exc, plugin)
            raise
        finally:
            providing_plugin.reset(token)

    return call


def _bound_observer(fn: Any, plugin: str, hook_name: str) -> Any:
    """A lifecycle observer whose failure is logged, so the other observers still run."""

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except (Exception, SystemExit):
            logger.exception("plugin %r raised in %s (ignored)", plugin, hook_name)
            return None

    return call


def _bound_wrapper(fn: Any, plugin: str, blame: Any) -> Any:
    """A pluggy wrapper (a generator) run step by step as ``plugin``."""

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        gen = fn(*args)
        step, value = gen.send, None
        while True:
            token = providing_plugin.set(plugin)
            try:
                out = step(value)
            except StopIteration as stop:
                return stop.value
            except BaseException as exc:
                blame(exc, plugin)
                raise
            finally:
                providing_plugin.reset(token)
            try:
                value, step = (yield out), gen.send
            except BaseException as exc:  # pluggy throws the inner exception in
                value, step = exc, gen.throw

    return wrapper


def make_plugin_manager(
    enabled: list[str] | None = None,
    disabled: Iterable[str] = (),
    *,
    load_entrypoints: bool = True,
    builtins: Mapping[str, str] | None = None,
    strict: bool | None = None,
) -> PluginHost:
    """Build a :class:`PluginHost`: built-ins first (every installed one, or
    ``builtins``), then each other entry point on its own.

    ``enabled``/``disabled`` come from the config's ``plugins`` section; the env vars
    ``ENGINECORE_PLUGINS`` (allow-list; empty means none), ``ENGINECORE_DISABLE_PLUGINS``,
    ``ENGINECORE_STRICT_PLUGINS`` and ``ENGINECORE_TRACE_PLUGINS`` take precedence
    (``strict`` overrides the env var: the ``plugins`` command lists every failure).
    """
    selection = PluginSelection.from_env(enabled, disabled)
    if strict is not None:
        selection.strict = strict
    host = PluginHost(selection)
    host.load_builtins(builtins)
    if load_entrypoints:
        host.load_entrypoints()
    return host
