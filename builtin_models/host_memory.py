"""Zero-filled tensors that cost nothing until touched."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``shape``. On CPU it is an anonymous mapping: the OS hands out
    zero pages on first touch, so nothing is written up front and resident memory grows
    with the part actually used (a KV cache sized for the worst case, a decode mirror
    regrown mid-run)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
