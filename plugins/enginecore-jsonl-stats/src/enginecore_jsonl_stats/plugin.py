"""The module the ``enginecore`` entry point names: hook implementations only.

The logger class is registered as a lazy ``"module:Class"`` string: nothing beyond this
module is imported unless a config lists ``"jsonl"`` in ``observability.stat_loggers``.
"""

from __future__ import annotations

import enginecore


@enginecore.hookimpl
def plugin_api_versions() -> str:
    return ">=1.0,<2"


@enginecore.hookimpl
def register_stat_loggers(registry) -> None:
    registry.add(
        "jsonl",
        "enginecore_jsonl_stats.logger:JsonlStatLogger",
        summary="one JSON line per engine step (path: $ENGINECORE_JSONL_STATS_PATH)",
    )
