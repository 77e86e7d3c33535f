"""One step's per-client share: at most ``max_num_seqs_per_client`` requests of one client.

Built by the scheduler only while more than one client has unfinished requests. A step's
time grows with its size (on CPUs, and on GPUs once steps are compute-bound), so a client
holding 160 sequences makes every step slow for a client holding one; capped, the other
client's request runs in small steps, and the capped client's requests take turns (those
that ran go to the back of the running list). With one client at work nothing is capped.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from enginecore.request import Request
    from enginecore_schedulers.scheduler import DefaultScheduler


class StepShare:
    """Requests scheduled this step per client, against the cap."""

    __slots__ = ("cap", "client_of", "counts", "turned_away", "_scheduler", "_waiting")

    def __init__(self, scheduler: DefaultScheduler) -> None:
        self._scheduler = scheduler
        self.cap = scheduler.max_num_seqs_per_client
        self.client_of = scheduler.client_of
        self.counts: dict[Hashable, int] = {}
        #: Whether a request was held back this step (then the running list rotates).
        self.turned_away = False
        # Per client, waiting requests that may still be admitted this step.
        self._waiting: dict[Hashable, int] = {}

    def full(self, request: Request) -> bool:
        """Whether the request's client already has its share of this step."""
        if self.counts.get(self.client_of[request.request_id], 0) >= self.cap:
            self.turned_away = True
            return True
        return False

    def take(self, request: Request) -> None:
        client = self.client_of[request.request_id]
        self.counts[client] = self.counts.get(client, 0) + 1

    def give_back(self, request: Request) -> None:
        """A request scheduled this step was preempted after all."""
        self.counts[self.client_of[request.request_id]] -= 1

    @staticmethod
    def rotate(running: list[Request], num_scheduled: dict[str, int]) -> list[Request]:
        """The running list with this step's requests behind those that did not run."""
        ran = [r for r in running if r.request_id in num_scheduled]
        return [r for r in running if r.request_id not in num_scheduled] + ran

    def count_waiting(self, running: list[Request]) -> None:
        """Before admission: each client's requests in the waiting queue still within
        its share (so admission stops once none is, instead of scanning a flood)."""
        scheduler = self._scheduler
        left = dict(scheduler.unfinished_per_client)
        client_of = self.client_of
        for request in running:
            left[client_of[request.request_id]] -= 1
        for request_id in scheduler.loading_remote_ids():
            left[client_of[request_id]] -= 1
        self._waiting = {
            client: n
            for client, n in left.items()
            if n > 0 and self.counts.get(client, 0) < self.cap
        }

    @property
    def admissible(self) -> bool:
        return bool(self._waiting)

    def others_waiting(self, client: Hashable) -> bool:
        """Whether a client other than ``client`` may still admit a request this step."""
        return any(other != client for other in self._waiting)

    def close(self, client: Hashable) -> None:
        """``client`` admits nothing more this step (a seat was taken from it)."""
        self.counts[client] = self.cap
        self._waiting.pop(client, None)

    def admit(self, request: Request) -> None:
        client = self.client_of[request.request_id]
        self.take(request)
        left = self._waiting.get(client, 0) - 1
        if left > 0 and self.counts[client] < self.cap:
            self._waiting[client] = left
        else:
            self._waiting.pop(client, None)
