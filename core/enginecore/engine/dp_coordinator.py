"""The data-parallel coordinator: which engine-core replica serves a new request.

One frontend owns every replica, so the coordinator lives in the frontend process (vLLM
needs a separate coordinator process only because several API servers share replicas).
It knows two things per replica:

- the requests the frontend has sent there and not yet seen finish or aborted
  (exact: every add, abort and finished output passes through the client), and
- the replica's latest ``SchedulerStats`` (running and waiting, as its scheduler saw
  them at its last step).

Internal load balancing picks the replica with the lowest score
``4 * waiting + running``, where ``running`` is the replica's last reported running
count and ``waiting`` is everything else the frontend has in flight there (queued in its
scheduler or still on the wire). Waiting weighs more because a queued request adds its
whole prefill to that replica's next steps. Ties go round-robin, so a burst sent before
any replica has reported spreads evenly.

External load balancing (``data_parallel_external_lb``) takes the replica each request
names in ``data_parallel_rank``; a rank may also be given per request under internal
balancing, and then wins.
"""

from __future__ import annotations

from enginecore.errors import EngineDeadError, InvalidRequestError
from enginecore.protocol import SchedulerStats

#: How much more one waiting request weighs than one running request.
WAITING_WEIGHT = 4


class DPCoordinator:
    """Per-replica load bookkeeping and the choice of replica for each request."""

    def __init__(self, size: int, *, external_lb: bool = False) -> None:
        if size < 1:
            raise ValueError("a data-parallel coordinator needs at least one replica")
        self.size = size
        self.external_lb = external_lb
        self.in_flight = [0] * size
        self.running = [0] * size
        self.dead: dict[int, str] = {}
        #: Requests each replica finished (not aborted, not lost): where traffic went.
        self.served = [0] * size
        self._next = 0  # round-robin start for ties

    def score(self, index: int) -> int:
        running = min(self.running[index], self.in_flight[index])
        waiting = self.in_flight[index] - running
        return WAITING_WEIGHT * waiting + running

    def choose(self, requested_rank: int | None = None) -> int:
        """The replica for a new request; raises if the request cannot be placed."""
        if requested_rank is not None:
            if not 0 <= requested_rank < self.size:
                raise InvalidRequestError(
                    f"data_parallel_rank {requested_rank} is out of range: this server runs "
                    f"{self.size} replicas (ranks 0..{self.size - 1})"
                )
            if requested_rank in self.dead:
                raise EngineDeadError(
                    f"data-parallel replica {requested_rank} is dead "
                    f"({self.dead[requested_rank]}); send the request to another rank"
                )
            return requested_rank
        if self.external_lb:
            raise InvalidRequestError(
                "data_parallel_external_lb is on: every request must name its replica with "
                f"data_parallel_rank (0..{self.size - 1})"
            )
        alive = [i for i in range(self.size) if i not in self.dead]
        if not alive:
            raise EngineDeadError("every data-parallel replica is dead")
        order = sorted(alive, key=lambda i: (i - self._next) % self.size)
        best = min(order, key=self.score)
        self._next = (best + 1) % self.size
        return best

    def on_added(self, index: int, count: int = 1) -> None:
        self.in_flight[index] += count

    def on_done(self, index: int, count: int = 1) -> None:
        """Requests that finished or were aborted on replica ``index``."""
        self.in_flight[index] = max(self.in_flight[index] - count, 0)

    def on_served(self, index: int) -> None:
        """A request finished on replica ``index`` (it is also :meth:`on_done`)."""
        self.served[index] += 1
        self.on_done(index)

    def on_stats(self, index: int, stats: SchedulerStats) -> None:
        self.running[index] = stats.num_running_reqs

    def on_dead(self, index: int, reason: str) -> None:
        self.dead[index] = reason
        self.in_flight[index] = 0
        self.running[index] = 0

    def on_restarted(self, index: int) -> None:
        """Replica ``index`` is back (a fresh engine core): it takes requests again."""
        self.dead.pop(index, None)
        self.in_flight[index] = 0
        self.running[index] = 0

    def alive(self) -> list[int]:
        return [i for i in range(self.size) if i not in self.dead]


def check_data_parallel_rank(size: int, external_lb: bool, rank: int | None) -> None:
    """Reject a bad ``data_parallel_rank`` before the request is tracked anywhere."""
    if rank is None:
        if external_lb and size > 1:
            raise InvalidRequestError(
                "data_parallel_external_lb is on: every request must name its replica with "
                f"data_parallel_rank (0..{size - 1})"
            )
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidRequestError(
            f"data_parallel_rank must be an int in 0..{size - 1} "
            f"(data_parallel_size is {size}), got {rank!r}"
        )
