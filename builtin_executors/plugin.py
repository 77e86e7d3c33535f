"""Built-in executors and worker RPCs, registered through the public hooks."""

from __future__ import annotations

import enginecore


@enginecore.hookimpl(trylast=True)
def register_executors(registry) -> None:
    registry.add(
        "uni",
        "enginecore.builtin_executors.uniproc:UniProcExecutor",
        summary="one worker inside the engine-core process",
    )
