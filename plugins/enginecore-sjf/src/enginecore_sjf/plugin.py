"""The module the ``enginecore`` entry point names: hook implementations only.

Keep this module cheap to import: enginecore imports it in every process that builds
registries. The policy class is registered as a lazy ``"module:Class"`` string, so
``enginecore_sjf.policy`` is imported only when a config selects ``scheduling_policy =
"sjf"``.
"""

from __future__ import annotations

import enginecore


@enginecore.hookimpl
def plugin_api_versions() -> str:
    # The plugin API versions this release was written and tested against.
    return ">=1.0,<2"


@enginecore.hookimpl
def register_scheduling_policies(registry) -> None:
    registry.add(
        "sjf",
        "enginecore_sjf.policy:ShortestJobFirstPolicy",
        summary="shortest job first: fewest prompt + output tokens left runs first",
    )
