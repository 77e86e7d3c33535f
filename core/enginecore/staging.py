"""Host <-> device copies of a step's inputs and outputs, guarded by events.

:class:`StagingBuffer` fills a persistent device buffer from host buffers (pinned on
CUDA, so ``non_blocking`` copies really are asynchronous). It keeps two host buffers and
writes one only once the event recorded after the copy that last read it has completed
(:meth:`StagingBuffer.ready`): a step that returns without a sync (a prompt chunk that
samples nothing) can never have its inputs overwritten by the next step's before the
device has read them.

:class:`HostCopy` is the step's one device-to-host copy: results are copied
asynchronously into pinned memory and read after a single wait on its event.

:class:`DeviceEvents` is the seam to the device: on CUDA it records ``torch.cuda.Event``
on the current stream; on CPU copies are synchronous and an event is complete once
recorded. Tests replace it with an instrumented stream to drive the same code on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch


class CopyEvent(Protocol):
    """A point in the device's queue: complete once everything queued before it ran."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Completed:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_COMPLETED = _Completed()


class DeviceEvents:
    """Events on the current stream of ``device`` (CPU: already complete)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def record(self) -> CopyEvent:
        if not self.cuda:
            return _COMPLETED
        event = torch.cuda.Event()
        event.record()
        return event


def _leading(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


class StagingBuffer:
    """A persistent device buffer filled from double-buffered host staging."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        events: DeviceEvents | None = None,
        num_host_buffers: int = 2,
        stage_on_host: bool = True,
    ) -> None:
        # ``stage_on_host=False`` on a CPU: the host buffers are what the model reads (no
        # device copy; the copy is the GPU's seam).
        self.direct = not stage_on_host and device.type == "cpu"
        self.device_buf = torch.zeros(shape, dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.hosts = [
            torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_host_buffers)
        ]
        self._arrays = [host.numpy() for host in self.hosts]
        self.events = events if events is not None else DeviceEvents(device)
        self._read_by: list[CopyEvent | None] = [None] * num_host_buffers
        self._next = 0
        # Direct: each host buffer's leading part of the last shape filled, the same
        # tensor while the shape repeats. Freeing a tensor gives up the interpreter lock,
        # and under async scheduling the engine's thread then holds it for a while.
        self._views: list[tuple[tuple[int, ...], torch.Tensor] | None] = [None] * num_host_buffers

    def ready(self) -> bool:
        """Whether the next host buffer may be written without waiting."""
        if self.direct:
            return True
        event = self._read_by[self._next]
        return event is None or event.query()

    def fill(self, values: np.ndarray) -> torch.Tensor:
        """Copy ``values`` into the device buffer's leading part; returns that part (direct:
        the host buffer's). Valid until the fill after next: read it within the step."""
        if self.direct:
            return self._fill_host(values)
        i = self._next
        event = self._read_by[i]
        if event is not None and not event.query():
            event.synchronize()  # the copy that read this buffer two fills ago
        index = _leading(values.shape)
        self._arrays[i][index] = values
        host = self.hosts[i][index]
        view = self.device_buf[index]
        view.copy_(host, non_blocking=True)
        self._read_by[i] = self.events.record()
        self._next = (i + 1) % len(self.hosts)
        return view

    def _fill_host(self, values: np.ndarray) -> torch.Tensor:
        i = self._next
        self._next = (i + 1) % len(self.hosts)
        shape = values.shape
        self._arrays[i][_leading(shape)] = values
        held = self._views[i]
        if held is not None and held[0] == shape:
            return held[1]
        view = self.hosts[i][_leading(shape)]
        self._views[i] = (shape, view)
        return view


class HostCopy:
    """The step's device-to-host copy: started without waiting, read after one wait.

    Host buffers are kept per name (the sampled ids, logprobs, prompt logprobs...), so
    steps that copy different sets reuse them; each grows to at least ``min_rows`` rows
    (the most a step samples), so steady decoding never allocates pinned memory.
    """

    def __init__(self, events: DeviceEvents, device: torch.device, min_rows: int = 1) -> None:
        self.events = events
        self.pin = device.type == "cuda"
        self.min_rows = min_rows
        # Per name: the host buffer and its numpy view (made once, so reading the copy
        # back is plain numpy).
        self._host: dict[str, tuple[torch.Tensor, np.ndarray]] = {}

    def _buffer(self, name: str, like: torch.Tensor) -> np.ndarray:
        n = like.shape[0]
        held = self._host.get(name)
        if held is not None:
            buf, array = held
            fits = buf.dtype == like.dtype and buf.shape[1:] == like.shape[1:]
            if fits and buf.shape[0] >= n:
                buf[:n].copy_(like, non_blocking=True)
                return array[:n]
        size = max(n, self.min_rows, 2 * held[0].shape[0] if held is not None else 0)
        buf = torch.empty((size, *like.shape[1:]), dtype=like.dtype, pin_memory=self.pin)
        self._host[name] = (buf, buf.numpy())
        buf[:n].copy_(like, non_blocking=True)
        return self._host[name][1][:n]

    def start(self, tensors: Mapping[str, torch.Tensor]) -> PendingCopy:
        """Queue copies of ``tensors`` to host memory; nothing waits here. The arrays
        :meth:`PendingCopy.wait` returns (by the same names) are reused by the next
        ``start``."""
        staged = {name: self._buffer(name, t) for name, t in tensors.items()}
        return PendingCopy(staged, self.events.record())


class PendingCopy:
    def __init__(self, host: dict[str, np.ndarray], event: CopyEvent) -> None:
        self.host, self.event = host, event

    def wait(self) -> dict[str, np.ndarray]:
        """The one host sync of a step: the copied values, as arrays."""
        self.event.synchronize()
        return self.host
