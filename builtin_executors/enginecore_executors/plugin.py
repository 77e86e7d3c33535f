"""Built-in executors and worker RPCs, registered through the public hooks."""

from __future__ import annotations

from typing import Any

import enginecore
from enginecore.registry import Registry


@enginecore.hookimpl(trylast=True)
def register_executors(registry: Registry[Any]) -> None:
    registry.add(
        "uni",
        "enginecore_executors.uniproc:UniProcExecutor",
        summary="one worker inside the engine-core process",
    )
    registry.add(
        "mp",
        "enginecore_executors.multiproc:MultiprocExecutor",
        summary="one spawned worker process per rank (ZeroMQ broadcast)",
    )
    registry.add(
        "ray",
        "enginecore_executors.ray_executor:RayExecutor",
        summary="workers as Ray actors in a placement group (multi-node); needs enginecore[ray]",
    )
    registry.add(
        "external_launcher",
        "enginecore_executors.external_launcher:ExternalLauncherExecutor",
        summary="one in-process worker per torchrun rank; every rank runs a whole engine",
    )


@enginecore.hookimpl(trylast=True)
def register_worker_rpcs(registry: Registry[Any]) -> None:
    from enginecore_executors.debug_rpcs import DEBUG_RPCS

    for name, (attr, summary) in DEBUG_RPCS.items():
        registry.add(name, f"enginecore_executors.debug_rpcs:{attr}", summary=summary)
