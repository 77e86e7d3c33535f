"""Registers the built-in scheduler and policies through the public hooks.

``trylast`` so the built-ins register first; a plugin may then replace one explicitly
with ``override=True``.
"""

from __future__ import annotations

from typing import Any

from enginecore.hookspecs import hookimpl
from enginecore.registry import Registry


@hookimpl(trylast=True)
def register_schedulers(registry: Registry[Any]) -> None:
    registry.add(
        "default",
        "enginecore_schedulers.scheduler:DefaultScheduler",
        summary="continuous batching with chunked prefill, preemption, prefix caching "
        "and async scheduling",
    )


@hookimpl(trylast=True)
def register_scheduling_policies(registry: Registry[Any]) -> None:
    registry.add(
        "fcfs",
        "enginecore_schedulers.policies:FCFSPolicy",
        summary="first come, first served; preempts the latest arrival",
    )
    registry.add(
        "priority",
        "enginecore_schedulers.policies:PriorityPolicy",
        summary="lowest priority value first, then arrival; preempts the lowest priority",
    )
    registry.add(
        "fair_share",
        "enginecore_schedulers.policies:FairSharePolicy",
        summary="interleaves clients: each client's n-th pending request before anyone's "
        "(n+1)-th; preempts the busiest client's latest",
    )
