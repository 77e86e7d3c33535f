"""The module the ``enginecore`` entry point names: hook implementations only.

The logger class is registered as a lazy ``"module:Class"`` string: nothing beyond this
module is imported unless a config lists ``"jsonl"`` in ``observability.stat_loggers``.
"""

from __future__ import annotations

import enginecore

# The type of the config table [plugins.jsonl_stats], as a lazy reference: enginecore
# validates the table against it and builds the logger with ``settings=``.
plugin_settings = "enginecore_jsonl_stats.logger:JsonlSettings"


@enginecore.hookimpl
def plugin_api_versions() -> str:
    return ">=1.0,<2"


@enginecore.hookimpl
def register_stat_loggers(registry) -> None:
    registry.add(
        "jsonl",
        "enginecore_jsonl_stats.logger:JsonlStatLogger",
        summary="one JSON line per engine step (path: [plugins.jsonl_stats] path)",
    )
