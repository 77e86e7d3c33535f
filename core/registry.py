"""A typed registry of named component factories, filled by the ``register_*`` hooks."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from enginecore.errors import DuplicateRegistrationError, PluginLoadError, UnknownComponentError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RegistryEntry:
    """One registered name: what builds it and which plugin added it."""

    name: str
    factory: Any  # a class/callable, or a lazy "module:attr" string
    plugin: str
    summary: str = ""
    overrides: str | None = None  # the plugin whose entry this one replaced
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
        ``features`` says what the component supports (shown by ``enginecore models``).
        """
        if not isinstance(name, str) or not name:
            raise PluginLoadError(
                f"plugin {self._current_plugin!r} registered a {self.kind} with an invalid "
                f"name {name!r}: names are non-empty strings"
            )
        if isinstance(factory, str) and ":" not in factory:
            raise PluginLoadError(
                f"plugin {self._current_plugin!r} registered {self.kind} {name!r} with "
                f"factory {factory!r}: a lazy factory must be a 'module:Class' string"
            )
        existing = self.entries.get(name)
        if existing is not None and not override:
            raise DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered twice: by plugin {existing.plugin!r} and "
                f"by plugin {self._current_plugin!r}. Disable one of them "
                f"(ENGINECORE_DISABLE_PLUGINS={self._current_plugin}) or register with "
                f"override=True to replace it on purpose."
            )
        if existing is not None:
            logger.info(
                "%s %r from plugin %r overrides the one from plugin %r",
                self.kind,
                name,
                self._current_plugin,
                existing.plugin,
            )
        self.entries[name] = RegistryEntry(
            name=name,
            factory=factory,
            plugin=self._current_plugin,
            summary=summary,
            overrides=existing.plugin if existing else None,
            features=tuple(features),
        )

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
            raise UnknownComponentError(self._unknown_message(name)) from None

    def get(self, name: str) -> Any:
        """Resolve ``name`` to its factory, importing a lazy reference now."""
        entry = self.entry(name)
        if isinstance(entry.factory, str):
            try:
                entry.factory = import_ref(entry.factory)
            except Exception as exc:
                raise PluginLoadError(
                    f"{self.kind} {name!r} from plugin {entry.plugin!r} could not be imported "
                    f"from {entry.ref!r}: {type(exc).__name__}: {exc}"
                ) from exc
        return entry.factory

    def _unknown_message(self, name: str) -> str:
        available = ", ".join(f"{n} (from {e.plugin})" for n, e in sorted(self.entries.items()))
        msg = f"unknown {self.kind} {name!r}. Available: {available or 'none'}."
        if self.failed_plugins:
            msg += (
                " These plugins failed to load and may have provided it: "
                + "; ".join(self.failed_plugins)
                + ". Run 'enginecore plugins' for their errors."
            )
        return msg
