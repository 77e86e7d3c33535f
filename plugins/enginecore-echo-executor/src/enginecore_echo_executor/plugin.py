"""The module the ``enginecore`` entry point names: hook implementations only.

The executor is registered as a lazy ``"module:Class"`` string, so nothing heavier than
this module is imported unless a config selects ``executor = "echo"``.
"""

from __future__ import annotations

import enginecore


@enginecore.hookimpl
def plugin_api_versions() -> str:
    return ">=1.0,<2"


@enginecore.hookimpl
def register_executors(registry) -> None:
    registry.add(
        "echo",
        "enginecore_echo_executor.executor:EchoExecutor",
        summary="wraps another executor (ENGINECORE_ECHO_INNER, default uni) and logs every RPC",
    )
