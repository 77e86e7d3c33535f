"""The built-in scheduling policies: small pure objects the scheduler consults.

Neither subclasses the scheduler, so async scheduling, chunked prefill and prefix caching
work the same under both (and under any third-party policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from enginecore.interfaces import SchedulingPolicy

if TYPE_CHECKING:
    from enginecore.request import Request


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: order by the engine's arrival counter.

    The preemption victim is the latest arrival, so the oldest requests keep progressing.
    """

    name = "fcfs"

    def sort_key(self, request: Request) -> int:
        return request.seq_no

    def pick_preemption_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_seq_no)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first, then earlier arrival.

    The preemption victim is the lowest-priority (highest value) request, the latest
    arrival among equals. With all priorities equal this behaves exactly like FCFS.
    """

    name = "priority"

    def sort_key(self, request: Request) -> tuple[int, int]:
        return (request.priority, request.seq_no)

    def pick_preemption_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self.sort_key)


class FairSharePolicy(SchedulingPolicy):
    """Interleave clients: order by the request's rank among its client's pending
    requests (``client_rank`` in ``SamplingParams.extra``, set by the server from the
    client's API key or address), then by arrival.

    A client with 400 requests queued no longer puts another client's single request
    behind all of them: that request ranks 0, like the first of the 400. Requests without
    a rank (offline ``LLM`` use) rank 0, which is FCFS. The preemption victim is the
    highest-ranked request, the latest arrival among equals.
    """

    name = "fair_share"

    def sort_key(self, request: Request) -> tuple[int, int]:
        return (client_rank(request), request.seq_no)

    def pick_preemption_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=self.sort_key)


def client_rank(request: Request) -> int:
    rank = (request.extra or {}).get("client_rank", 0)
    return rank if type(rank) is int and rank >= 0 else 0


def _seq_no(request: Request) -> int:
    return request.seq_no
