"""The module the ``enginecore`` entry point names: hook implementations only.

The proposer is registered as a lazy ``"module:Class"`` string: workers import
``enginecore_cycle_proposer.proposer`` only when a config selects
``speculative_method = "cycle"``.
"""

from __future__ import annotations

import enginecore


@enginecore.hookimpl
def plugin_api_versions() -> str:
    return ">=1.0,<2"


@enginecore.hookimpl
def register_spec_decode_proposers(registry) -> None:
    registry.add(
        "cycle",
        "enginecore_cycle_proposer.proposer:CycleProposer",
        summary="continue a loop: the text's tail repeats with a short period",
    )
