"""A request's ``kv_transfer_params``, checked in the frontend against the connector's schema.

A KV connector declares the type of the ``kv_transfer_params`` it reads
(:attr:`enginecore.interfaces.KVConnectorFactory.transfer_params_type`, a
:class:`msgspec.Struct`) and, where the answer depends on its configuration (a peer that
must be configured), :meth:`~enginecore.interfaces.KVConnectorFactory.check_transfer_params`.
Every request is checked here, before anything is scheduled: a bad field is the client's
error (400 naming the field), never an exception inside the engine's scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from enginecore.config import EngineConfig
from enginecore.errors import InvalidRequestError
from enginecore.interfaces import KVConnectorFactory
from enginecore.plugin_settings import readable_validation_error
from enginecore.registry import import_ref

if TYPE_CHECKING:
    from enginecore.plugins import PluginHost


class KVTransferParamsValidator:
    """Built once per frontend; the connector's factory is imported on first use."""

    def __init__(self, config: EngineConfig, plugins: PluginHost | None = None) -> None:
        self.config = config
        self._plugins = plugins
        self._factory: KVConnectorFactory | None = None

    def _connector(self) -> KVConnectorFactory:
        if self._factory is None:
            plugins = self._plugins
            if plugins is None:
                from enginecore.plugins import make_plugin_manager

                selection = self.config.plugins
                plugins = make_plugin_manager(selection.enabled, selection.disabled)
            name = self.config.kv_transfer.connector or ""
            entry = plugins.registry("kv_connector").entry(name)
            self._factory = import_ref(entry.ref)()
        return self._factory

    def validate(self, params: dict[str, Any] | None) -> None:
        """Raise :class:`InvalidRequestError` naming the field at fault."""
        if params is None or not self.config.kv_transfer.connector:
            return
        connector = self._connector()
        params_type = connector.transfer_params_type
        if params_type is None:
            return
        try:
            typed = msgspec.convert(params, params_type)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(
                f"kv_transfer_params: {readable_validation_error(exc)}"
            ) from None
        try:
            connector.check_transfer_params(self.config, typed)
        except ValueError as exc:
            raise InvalidRequestError(f"kv_transfer_params: {exc}") from None
