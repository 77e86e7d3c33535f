"""Which LoRA adapters the workers hold read, so requests are admitted only once theirs is.

A waiting request whose adapter is not read yet stays in the queue (the requests behind
it are admitted past it) while every step asks the workers to read the adapter
(``SchedulerOutput.lora_loads``); the workers' ``lora_report`` marks it ready, or failed
with the reason, which then fails the requests naming it and nothing else. A read asked
for with no request (``request_load``: the server's ``/v1/load_lora_adapter``) answers
its future when the report comes.
"""

from __future__ import annotations

from concurrent.futures import Future

from enginecore.lora_request import LoRAAdapterError, LoRALoadReport, LoRARequest


class LoRAAdmission:
    def __init__(self) -> None:
        self.ready_ids: set[int] = set()
        self.loading: dict[int, LoRARequest] = {}
        self._waiters: dict[int, list[Future[bool]]] = {}

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

    @property
    def pending(self) -> bool:
        """Reads asked for and not yet reported: the engine keeps stepping for them."""
        return bool(self.loading)

    def loads(self) -> list[LoRARequest]:
        return list(self.loading.values())

    def apply(self, report: LoRALoadReport | None) -> dict[int, str]:
        """Take the workers' report; returns the adapters that failed, with the reason."""
        if report is None:
            return {}
        for lora_id in report.evicted:
            self.ready_ids.discard(lora_id)
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
