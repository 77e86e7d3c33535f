"""Host memory for CPU workers: zero-filled tensors that cost nothing until touched, and
a malloc that keeps freed memory for the next step."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import platform

import torch

logger = logging.getLogger(__name__)

# How much of the KV cache, and of the decode mirror, a CPU runner faults in at start-up
# (see ``DecodeMirror.prefault`` and ``TorchModelRunner._prefault``).
PREFAULT_BYTES = 256 << 20

# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


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
    # Private, not mmap's default shared mapping: a first touch then costs ~0.6 µs
    # instead of ~0.9 (no shmem page cache), and a forked child copies instead of sharing.
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse instead of handing them back to
    the OS. Returns whether it took.

    By default glibc serves blocks over a moving threshold (128 KiB to 32 MiB) with a
    fresh mmap, unmaps them on free and trims the heap top beyond twice that. A CPU step
    allocates and frees the same few-MiB activations every layer, so each one would be
    faulted in again: thousands of page faults per 2,048-token step, several times more
    once MKL's packed GEMM shares the heap.
    Fixing the mmap threshold at its 32 MiB maximum and the trim threshold at 1 GiB keeps
    those pages mapped; resident memory stays at the step's high-water mark.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken: bool = (
        mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    )
    if not taken:
        logger.info("mallopt refused the thresholds; freed memory goes back to the OS")
    return taken
