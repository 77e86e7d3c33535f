"""Which LoRA adapters the workers hold read, so requests are admitted only once theirs is.

A waiting request whose adapter is not read yet stays in the queue (the requests behind
it are admitted past it) while every step asks the workers to read the adapter
(``SchedulerOutput.lora_loads``); the workers' ``lora_report`` marks it ready, or failed
with the reason, which then fails the requests naming it and nothing else. A read asked
for with no request (``request_load``: the server's ``/v1/load_lora_adapter``) answers
its future when the report comes. The ``--lora-modules`` adapters are ready from the
start (the workers read them while the engine starts).

Unloading (``request_removal``) waits until no request in the scheduler names the
adapter: requests already queued or running finish with it. Then the step's
``SchedulerOutput.lora_removals`` has every worker free its copies, and the future
answers when the workers report it dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

from enginecore.lora_request import LoRAAdapterError, LoRALoadReport, LoRARequest


class LoRAAdmission:
    def __init__(self, ready: Iterable[int] = ()) -> None:
        self.ready_ids: set[int] = set(ready)
        self.loading: dict[int, LoRARequest] = {}
        self._waiters: dict[int, list[Future[bool]]] = {}
        # Unloads asked for (sent once no request names the adapter), and those sent to
        # the workers whose report has not come yet.
        self.removing: dict[int, list[Future[bool]]] = {}
        self._removed: dict[int, list[Future[bool]]] = {}

    def is_ready(self, lora_request: LoRARequest | None) -> bool:
        """Whether a request with this adapter may be admitted; asks for the read if not."""
        if lora_request is None or lora_request.lora_int_id in self.ready_ids:
            return True
        self.loading.setdefault(lora_request.lora_int_id, lora_request)
        return False

    def request_load(self, lora_request: LoRARequest) -> Future[bool]:
        """Have the workers read the adapter; the future is True once they have, or holds
        the read's error."""
        future: Future[bool] = Future()
        if self.is_ready(lora_request):
            future.set_result(True)
        else:
            self._waiters.setdefault(lora_request.lora_int_id, []).append(future)
        return future

    def request_removal(self, lora_int_id: int) -> Future[bool]:
        """Have the workers drop the adapter once no request names it; the future is
        True once they have."""
        future: Future[bool] = Future()
        self.removing.setdefault(lora_int_id, []).append(future)
        return future

    def removals(self, in_use: set[int]) -> list[int]:
        """The unloads to send this step: those no request (``in_use``) names."""
        sent = [lora_id for lora_id in self.removing if lora_id not in in_use]
        for lora_id in sent:
            self._removed.setdefault(lora_id, []).extend(self.removing.pop(lora_id))
            self.ready_ids.discard(lora_id)
            self.loading.pop(lora_id, None)
            for future in self._waiters.pop(lora_id, ()):
                future.set_exception(LoRAAdapterError(f"LoRA adapter {lora_id} was unloaded"))
        return sent

    @property
    def pending(self) -> bool:
        """Reads or unloads asked for and not yet reported: the engine keeps stepping."""
        return bool(self.loading or self.removing or self._removed)

    def loads(self) -> list[LoRARequest]:
        return list(self.loading.values())

    def apply(self, report: LoRALoadReport | None) -> dict[int, str]:
        """Take the workers' report; returns the adapters that failed, with the reason."""
        if report is None:
            return {}
        for lora_id in report.evicted:
            self.ready_ids.discard(lora_id)
            for future in self._removed.pop(lora_id, ()):
                future.set_result(True)
        for lora_id in report.loaded:
            self.ready_ids.add(lora_id)
            self.loading.pop(lora_id, None)
            for future in self._waiters.pop(lora_id, ()):
                future.set_result(True)
        for lora_id, message in report.failed.items():
            self.ready_ids.discard(lora_id)
            self.loading.pop(lora_id, None)
            for future in self._waiters.pop(lora_id, ()):
                future.set_exception(LoRAAdapterError(message))
        return dict(report.failed)
