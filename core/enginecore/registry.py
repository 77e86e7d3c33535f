"""A typed registry of named component factories, filled by the ``register_*`` hooks."""

from __future__ import annotations

import contextvars
import difflib
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from enginecore.errors import DuplicateRegistrationError, PluginLoadError, UnknownComponentError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The plugin whose hook implementation is running: every ``Registry.add`` made meanwhile
#: is recorded as provided by it (set by the plugin host around each implementation).
providing_plugin: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "enginecore_providing_plugin", default=None
)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" Did you mean 'x'?"`` for the closest choices, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@dataclass
class RegistryEntry:
    """One registered name: what builds it and which plugin added it."""

    name: str
    factory: Any  # a class/callable, or a lazy "module:attr" string
    plugin: str
    summary: str = ""
    overrides: str | None = None  # the plugin whose entry this one replaced
    overriding: bool = False  # registered with override=True
    # What the component supports, in the registry kind's vocabulary (for models:
    # "sliding_window", "moe", "gguf", "tp", "pp"); listed by ``enginecore models``.
    features: tuple[str, ...] = ()

    @property
    def ref(self) -> str:
        """The factory as a ``module:attr`` reference that another process can import."""
        if isinstance(self.factory, str):
            return self.factory
        return f"{self.factory.__module__}:{self.factory.__qualname__}"


def import_ref(ref: str) -> Any:
    """Import a ``module:attr`` reference (``attr`` may be dotted)."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginLoadError(f"{ref!r} is not a 'module:attr' reference")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Registry(Generic[T]):
    """Names to factories for one kind of component (schedulers, executors, ...).

    Plugins receive a registry in their ``register_*`` hook and call :meth:`add`. The
    plugin manager binds each hook call to the calling plugin, so every entry records
    who provided it.
    """

    kind: str
    entries: dict[str, RegistryEntry] = field(default_factory=dict)
    _current_plugin: str = "<direct>"
    # Plugins that failed to load: shown when a name is missing, since one of them may
    # have provided it.
    failed_plugins: list[str] = field(default_factory=list)
    # Plugin name -> load position. Hooks run in pluggy's order (built-ins last), so when
    # two plugins register one name the one loaded later is the one at fault, whoever
    # ran first.
    load_order: dict[str, int] = field(default_factory=dict)
    # Entries dropped when added because they are not what this kind needs:
    # (plugin, name, what is wrong). The plugin host reports them against the plugin.
    rejected: list[tuple[str, str, str]] = field(default_factory=list)

    def add(
        self,
        name: str,
        factory: type[T] | Callable[..., T] | str,
        *,
        summary: str = "",
        override: bool = False,
        features: tuple[str, ...] | list[str] = (),
    ) -> None:
        """Register ``factory`` under ``name``.

        ``factory`` is a class or callable, or a lazy ``"module:Class"`` string that is
        imported only if the name is selected. A name that another plugin already
        registered is an error unless ``override=True``, which replaces it and is logged.
        The outcome does not depend on which plugin's hook runs first.
        ``features`` says what the component supports (shown by ``enginecore models``).
        A factory that is not what the kind needs (see
        :mod:`enginecore.registration_check`) is dropped and reported against the plugin;
        the plugin's other entries stay.
        """
        plugin = providing_plugin.get() or self._current_plugin
        if not isinstance(name, str) or not name:
            raise PluginLoadError(
                f"plugin {plugin!r} registered a {self.kind} with an invalid "
                f"name {name!r}: names are non-empty strings"
            )
        if isinstance(factory, str) and ":" not in factory:
            raise PluginLoadError(
                f"plugin {plugin!r} registered {self.kind} {name!r} with "
                f"factory {factory!r}: a lazy factory must be a 'module:Class' string"
            )
        if not isinstance(factory, str):
            from enginecore.registration_check import registration_problem

            problem = registration_problem(self.kind.replace(" ", "_"), name, factory)
            if problem is not None:
                self.rejected.append((plugin, name, problem))
                return
        existing = self.entries.get(name)
        if existing is not None and not override:
            if existing.overriding and existing.overrides is None:
                # The replacement ran before the original: keep it, note what it replaced.
                existing.overrides = plugin
                self._log_override(name, existing.plugin, plugin)
                return
            first, second = sorted(
                (existing.plugin, plugin),
                key=lambda p: self.load_order.get(p, len(self.load_order)),
            )
            error = DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered twice: by plugin {first!r} and by plugin "
                f"{second!r}. Disable one of them (ENGINECORE_DISABLE_PLUGINS={second}) or "
                f"register with override=True to replace it on purpose."
            )
            error.plugin = second  # the one dropped: the plugin loaded later
            raise error
        if existing is not None:
            self._log_override(name, plugin, existing.plugin)
        self.entries[name] = RegistryEntry(
            name=name,
            factory=factory,
            plugin=plugin,
            summary=summary,
            overrides=existing.plugin if existing else None,
            overriding=override,
            features=tuple(features),
        )

    def _key_hint(self) -> str:
        """``". Select another scheduler (config key scheduler.name)."``, or ``""``."""
        from enginecore.component_kinds import KINDS

        kind = KINDS.get(self.kind.replace(" ", "_"))
        if kind is None or kind.config_key is None:
            return ""
        return f". Fix the plugin, or select another {kind.label} (config key {kind.config_key})"

    def _log_override(self, name: str, new: str, old: str) -> None:
        logger.info(
            "%s %r from plugin %r overrides the one from plugin %r", self.kind, name, new, old
        )

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self.entries) or 'empty'})"

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def entry(self, name: str) -> RegistryEntry:
        """The entry for ``name``, or an error that lists what is available and from whom."""
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownComponentError(self.unknown_message(name)) from None

    def get(self, name: str) -> Any:
        """Resolve ``name`` to its factory, importing a lazy reference now."""
        entry = self.entry(name)
        if isinstance(entry.factory, str):
            try:
                factory = import_ref(entry.factory)
            except Exception as exc:
                raise PluginLoadError(
                    f"{self.kind} {name!r} from plugin {entry.plugin!r} could not be imported "
                    f"from {entry.ref!r}: {type(exc).__name__}: {exc}{self._key_hint()}"
                ) from exc
            from enginecore.registration_check import registration_problem

            problem = registration_problem(self.kind.replace(" ", "_"), name, factory)
            if problem is not None:
                raise PluginLoadError(
                    f"plugin {entry.plugin!r} registered {problem}{self._key_hint()}"
                )
            entry.factory = factory
        return entry.factory

    def unknown_message(self, name: str) -> str:
        """What is wrong with ``name``: close matches, what is available and from whom."""
        available = ", ".join(f"{n} (from {e.plugin})" for n, e in sorted(self.entries.items()))
        msg = f"unknown {self.kind} {name!r}.{did_you_mean(name, self.entries)}"
        msg += f" Available: {available or 'none'}."
        if self.failed_plugins:
            msg += (
                " These plugins failed to load and may have provided it: "
                + ", ".join(self.failed_plugins)
                + " (run 'enginecore plugins' for their errors)."
            )
        return msg
