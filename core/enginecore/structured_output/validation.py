"""The frontend's early check of a constraint, so a bad one is refused before it is queued."""

from __future__ import annotations

from typing import TYPE_CHECKING

from enginecore.params import StructuredOutputParams
from enginecore.structured_output.keys import grammar_key

if TYPE_CHECKING:
    from enginecore.config import EngineConfig
    from enginecore.interfaces import StructuredOutputBackend
    from enginecore.plugins import PluginHost


class StructuredOutputValidator:
    """Calls the selected backend's ``validate`` (the plugin host is built on first use)."""

    def __init__(self, config: EngineConfig, plugins: PluginHost | None = None) -> None:
        self.config = config
        self._plugins = plugins
        self._backend_cls: type[StructuredOutputBackend] | None = None
        self._valid: set[tuple[str, str]] = set()  # keys already validated (bounded below)

    def validate(self, spec: StructuredOutputParams) -> None:
        """Raise :class:`InvalidRequestError` with the compiler's message for a bad constraint."""
        if self._backend_cls is None:
            if self._plugins is None:
                from enginecore.plugins import make_plugin_manager

                plugins = self.config.plugins
                self._plugins = make_plugin_manager(plugins.enabled, plugins.disabled)
            registry = self._plugins.registry("structured_output_backend")
            self._backend_cls = registry.get(self.config.structured_output.backend)
        key = grammar_key(spec)
        if key in self._valid:
            return
        self._backend_cls.validate(spec)
        if len(self._valid) >= 4096:
            self._valid.clear()
        self._valid.add(key)
