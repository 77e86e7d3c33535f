"""Counting the host's reads of device values on CPU (the one-sync-per-step tests).

On a GPU every read of a device value on the host (``tolist``, ``item``, ``bool``,
``int`` of a tensor, ``.cpu()``, ``.numpy()``) waits for all queued work. On CPU a torch
function mode counts the same reads, and the runner's device events (its ``events``
seam) are replaced by ones that count their waits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}


class SyncCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class CountingEvent:
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.counter.reads.append("event.synchronize")


def count_reads(runner: Any) -> SyncCounter:
    """A counter wired to ``runner``'s device events, its sampler on the GPU's path."""
    runner.sampler.host_reads_free = False
    counter = SyncCounter()
    runner.events.record = lambda: CountingEvent(counter)
    return counter


class BlockingCopyCounter(TorchFunctionMode):
    """Counts copies onto a device that are not ``non_blocking``: on CUDA such a copy from
    host memory synchronises the stream (it waits for the queued forward). On a CPU they
    show as ``.to(device)`` / ``torch.tensor(..., device=...)`` calls naming a device."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("to", "tensor", "as_tensor") and not kwargs.get("non_blocking"):
            positional = [a for a in args[1:] if isinstance(a, torch.device | str)]
            if kwargs.get("device") is not None or positional:
                self.copies.append(name)
        return func(*args, **kwargs)
