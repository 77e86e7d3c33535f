"""Each plugin's own settings: the ``[plugins.NAME]`` table of the config, typed by the plugin.

A plugin declares a :class:`msgspec.Struct` as ``plugin_settings`` on its plugin module
(or a lazy ``"module:Type"`` string). The table ``[plugins.NAME]`` (``NAME`` as
``enginecore plugins`` lists it) is validated against that type before any process
starts, and the components the plugin provides are built with ``settings=<instance>``.
Code that is not built by enginecore (a worker RPC, a lifecycle hook) reads the same
settings with :func:`plugin_settings`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from enginecore.errors import ConfigError
from enginecore.registry import did_you_mean

T = TypeVar("T")

_AT_KEY = re.compile(r" - at `\$\.(\w+)")


def plugin_settings(config: Any, plugin: str, settings_type: type[T]) -> T:
    """The plugin's ``[plugins.NAME]`` table as a ``settings_type`` (defaults when absent).

    Raises :class:`~enginecore.errors.ConfigError` naming the table and the key at fault.
    """
    table = config.plugins.config.get(plugin, {})
    where = f"[plugins.{plugin}]"
    fields = getattr(settings_type, "__struct_fields__", None)
    if fields is not None:
        for key in table:
            if key not in fields:
                raise ConfigError(
                    f"{where}: unknown key {key!r} for plugin {plugin!r}.{did_you_mean(key, fields)}"
                    f" Its settings are: {', '.join(fields) or 'none'}."
                )
    try:
        return msgspec.convert(table, settings_type, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_KEY.search(text)
        if match:
            text = f"key {match.group(1)!r}: {_AT_KEY.sub('', text)}"
        raise ConfigError(f"{where}: invalid settings for plugin {plugin!r}: {text}") from None


_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")


def readable_validation_error(exc: msgspec.ValidationError) -> str:
    """msgspec's message with the field first: ``"num_tokens: Expected `int`, got `str`"``."""
    text = str(exc)
    match = _AT_PATH.search(text)
    if match is None:
        return text
    return f"{match.group(1) or '(the whole value)'}: {text[: match.start()]}"
