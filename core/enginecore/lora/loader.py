"""Reading LoRA adapters off the step: a background thread per read, results collected
between steps.

The scheduler names adapters its waiting requests need (``SchedulerOutput.lora_loads``);
the runner starts their reads here and keeps stepping the requests it has. A finished
read is collected by the next step (``finished``); a step that needs an adapter still
being read (another tensor-parallel rank got there first) waits for that read only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from enginecore.lora.adapter import LoRAAdapter
from enginecore.lora_request import LoRAAdapterError, LoRARequest

logger = logging.getLogger(__name__)


def load_error(lora_request: LoRARequest, exc: BaseException) -> str:
    """The message a failed read gives the requests naming the adapter."""
    reason = str(exc) if isinstance(exc, LoRAAdapterError) else f"{type(exc).__name__}: {exc}"
    return (
        f"LoRA adapter {lora_request.lora_name!r} (path {lora_request.lora_path!r}) "
        f"could not be loaded: {reason}"
    )


class AdapterLoader:
    """Adapter reads in flight, keyed by ``lora_int_id``. Each runs on a daemon thread:
    a read that never ends (a dead mount) never holds the process open at exit."""

    def __init__(self, read: Callable[[LoRARequest], LoRAAdapter]) -> None:
        self._read = read
        self._reads: dict[int, tuple[LoRARequest, Future[LoRAAdapter]]] = {}
        self.reads_started = 0  # every read begun (the ``lora_state`` RPC reports it)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._reads

    def start(self, lora_request: LoRARequest) -> None:
        """Begin reading the adapter unless a read of it is in flight."""
        if lora_request.lora_int_id in self._reads:
            return
        logger.info(
            "reading LoRA adapter %r from %s", lora_request.lora_name, lora_request.lora_path
        )
        future: Future[LoRAAdapter] = Future()
        self.reads_started += 1
        self._reads[lora_request.lora_int_id] = (lora_request, future)
        threading.Thread(
            target=self._run,
            args=(lora_request, future),
            name=f"lora-read-{lora_request.lora_int_id}",
            daemon=True,
        ).start()

    def _run(self, lora_request: LoRARequest, future: Future[LoRAAdapter]) -> None:
        try:
            future.set_result(self._read(lora_request))
        except BaseException as exc:  # handed to the step that collects the read
            future.set_exception(exc)

    def finished(self) -> list[tuple[LoRARequest, Future[LoRAAdapter]]]:
        """The reads done since the last call (each future holds the adapter or the error)."""
        done = [(lora, future) for lora, future in self._reads.values() if future.done()]
        for lora, _ in done:
            del self._reads[lora.lora_int_id]
        return done

    def discard(self, lora_int_id: int) -> None:
        """Forget a read in flight (its adapter was unloaded); its thread ends unheard."""
        self._reads.pop(lora_int_id, None)

    def wait(self, lora_int_id: int) -> tuple[LoRARequest, Future[LoRAAdapter]]:
        """Block until the read of this adapter is done; it leaves the reads in flight."""
        lora, future = self._reads.pop(lora_int_id)
        future.exception()  # waits; the caller reads the result or the error
        return lora, future
