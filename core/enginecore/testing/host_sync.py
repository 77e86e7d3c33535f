"""``forbid_host_sync()``: a guard that raises on every tensor operation that makes the
host wait for the device, so code meant to run under a CUDA graph (or without stalling a
GPU's queue) can be checked on a CPU, where ``torch.cuda.set_sync_debug_mode`` does not
apply.

It is a ``TorchFunctionMode``: every torch function and tensor method called inside it
passes through, and those that read a device value on the host (``.tolist()``,
``.item()``, ``.cpu()``, ``bool(t)``...) or whose output shape depends on the values
(``nonzero``, boolean-mask indexing, ``bincount``, ``unique``...) raise
:class:`HostSyncError` naming the operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncError", "forbid_host_sync"]


class HostSyncError(RuntimeError):
    """An operation that waits for the device ran inside ``forbid_host_sync()``."""


_READS_ON_HOST = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
_VALUE_SHAPED = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.argwhere,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.bincount,
    torch.Tensor.bincount,
    torch.unique,
    torch.Tensor.unique,
    torch.unique_consecutive,
    torch.repeat_interleave,
    torch.Tensor.repeat_interleave,
}


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", None) or repr(func)


def _bool_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _host_sync(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in _READS_ON_HOST or func in _VALUE_SHAPED:
        return True
    if func is torch.Tensor.__getitem__ and len(args) > 1:
        return _bool_mask(args[1])
    if func is torch.where and len(args) + len(kwargs) == 1:
        return True  # torch.where(cond) is nonzero
    if func is torch.Tensor.to:  # .to("cpu"), as .cpu()
        targets = [*args[1:], kwargs.get("device")]
        return any(
            isinstance(t, str | torch.device) and torch.device(t).type == "cpu" for t in targets
        )
    return False


class _ForbidHostSync(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _host_sync(func, args, kwargs):
            raise HostSyncError(
                f"{_name(func)} makes the host wait for the device (forbidden here: it "
                "stalls the GPU's queue and cannot be captured in a CUDA graph)"
            )
        return func(*args, **kwargs)


@contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise :class:`HostSyncError` on any host sync inside the block."""
    with _ForbidHostSync():
        yield
