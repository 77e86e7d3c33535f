"""``FairSharePolicy``: FCFS, but no tenant holds more than its share of running slots.

The tenant is read from the request's user metadata (``SamplingParams(extra={"tenant":
...})``); the running requests are counted from the ``SchedulerState`` the scheduler
passes to ``admit``, so the policy keeps no state of its own.
"""

from __future__ import annotations

import msgspec

from enginecore.interfaces import SchedulingPolicy


class FairShareSettings(msgspec.Struct, kw_only=True):
    """The ``[plugins.fair_share]`` table."""

    max_running_per_tenant: int = 1
    tenant_key: str = "tenant"


class FairSharePolicy(SchedulingPolicy):
    name = "tenant_cap"

    def __init__(self, config, *, settings: FairShareSettings | None = None) -> None:
        super().__init__(config)
        self.settings = settings or FairShareSettings()

    def tenant(self, request) -> str | None:
        return (request.extra or {}).get(self.settings.tenant_key)

    def sort_key(self, request):
        return request.seq_no

    def admit(self, request, state) -> bool:
        tenant = self.tenant(request)
        if tenant is None:
            return True
        running = sum(self.tenant(r) == tenant for r in state.running)
        return running < self.settings.max_running_per_tenant
