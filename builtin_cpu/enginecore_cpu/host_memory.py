"""Host memory for CPU workers: zero-filled tensors that cost nothing until touched, and
a malloc that keeps freed memory for the next step."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import platform
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The most of the KV cache a CPU runner faults in once started: one sequence of the
# longest length, up to this (see ``attention.prefault_blocks``).
PREFAULT_BYTES = 256 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, contents unchanged

Region = tuple[int, int]  # an address and a length in bytes

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


def release_freed_memory() -> int:
    """Hand the pages of freed malloc blocks back to the OS, in every arena (glibc's
    ``malloc_trim``); returns the bytes of resident memory released. Called once the
    model is loaded: what the load freed (the checkpoint's header and tables, the
    tokenizer's conversion, the layers' construction) would otherwise stay resident for
    the process's life, since :func:`keep_freed_memory` keeps freed memory for the steps."""
    if platform.libc_ver()[0] != "glibc":
        return 0
    before = _resident_bytes()
    ctypes.CDLL(None).malloc_trim(0)
    return before - _resident_bytes()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise``, where there is one."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


@functools.cache
def _populate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise``, where it takes ``MADV_POPULATE_WRITE`` (tried on one page)."""
    madvise = _madvise()
    if madvise is None:
        return None
    page = mmap.mmap(-1, mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    taken = madvise(address, mmap.PAGESIZE, _MADV_POPULATE_WRITE) == 0
    del address
    page.close()
    return madvise if taken else None


def advise_reads(mapped: torch.Tensor, streamed: bool) -> bool:
    """Tell the OS how the mapping under ``mapped`` (a tensor made by mapping a file or
    anonymous memory: its storage starts the mapping) will be read, before a page of it
    is touched. Returns whether the advice was taken.

    ``streamed``: read whole, again and again (a weight, every decode step), so backed by
    transparent huge pages. With 4 KiB pages each page costs a TLB miss (a nested walk in
    a virtual machine) and stops the hardware prefetcher at its boundary, so the kernels
    read memory well below its bandwidth. For a mapped file this also makes the kernel
    read the file into huge page-cache folios, and fill them when a shared mapping writes
    it, where the file system supports them (ext4 and XFS on recent kernels).

    Otherwise read a row at a time at random (a token embedding's table): no read-ahead,
    and a shared mapping's writes fill small folios. A mapping maps a page-cache folio
    whole, so with large folios every row looked up would make up to 2 MiB resident."""
    storage = mapped.untyped_storage()
    if storage.nbytes() == 0:
        return False
    address = storage.data_ptr()
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    advice = "MADV_HUGEPAGE" if streamed else "MADV_RANDOM"
    return _advise(start, address + storage.nbytes() - start, advice)


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, and arm64 with 4 KiB base pages)
_MADV_COLLAPSE = 25  # Linux 6.1: make a range huge pages now, contents unchanged


def advise_pages(address: int, length: int, huge: bool) -> bool:
    """Advise anonymous memory ``[address, address + length)`` (page-aligned) into
    transparent huge pages (``huge``: the pages faulted in from now on) or out of them
    (``MADV_NOHUGEPAGE``: not even where THP is ``always``). Returns whether the advice
    was taken."""
    return _advise(address, length, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE")


def _advise(address: int, length: int, name: str) -> bool:
    """``madvise`` of the page-aligned range with the advice ``mmap`` names ``name``;
    whether it was taken (not where libc or this Python lacks it)."""
    madvise = _madvise()
    advice = getattr(mmap, name, None)
    if madvise is None or advice is None or length <= 0:
        return False
    return bool(madvise(address, length, advice) == 0)


def collapse_in_background(owner: torch.Tensor, address: int, length: int) -> threading.Thread:
    """Copy the small pages already in ``[address, address + length)`` (memory of
    ``owner``, held until done; advised into huge pages) into huge pages, contents
    unchanged, on a daemon thread (``MADV_COLLAPSE``): it can take the kernel a second
    to find free huge pages, which a decode step must not wait for, and the steps may
    write the range meanwhile. Where the kernel lacks it (before Linux 6.1) the pages
    stay small."""
    madvise = _madvise()

    def run() -> None:
        try:
            if madvise is not None:
                madvise(address, length, _MADV_COLLAPSE)
        finally:
            del held[:]

    held = [owner]  # its memory stays mapped until the thread is done
    thread = threading.Thread(target=run, daemon=True, name="enginecore-collapse")
    thread.start()
    return thread


def mappings_under(*tensors: torch.Tensor) -> dict[str, Any]:
    """What ``/proc/self/smaps`` says of the mappings under the ``tensors``' storage, each
    mapping once: each size field (``Rss``, ``AnonHugePages``, ``FilePmdMapped``, ...) in
    bytes, summed over them, and ``VmFlags`` as the set of their flags (``hg``: advised
    into huge pages, ``nh``: out of them). Linux only."""
    spans = [
        (t.untyped_storage().data_ptr(), max(1, t.untyped_storage().nbytes())) for t in tensors
    ]
    fields: dict[str, Any] = {"VmFlags": set()}
    ours = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(a, 16) for a in parts[0].split("-"))
                ours = any(lo < at + n and at < hi for at, n in spans)
            elif ours and parts[0] == "VmFlags:":
                fields["VmFlags"] |= set(parts[1:])
            elif ours and len(parts) == 3 and parts[2] == "kB":
                fields[parts[0][:-1]] = fields.get(parts[0][:-1], 0) + int(parts[1]) * 1024
    return fields


def region(span: torch.Tensor) -> Region:
    """The memory of a contiguous tensor."""
    return span.data_ptr(), span.numel() * span.element_size()


class Prefault:
    """A background prefault (:func:`prefault_in_background`): wait for it, or stop it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._stopping = threading.Event()

    def is_set(self) -> bool:
        """Whether it is over: every page in, or stopped."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Stop at the next region and wait until the thread has let go of the memory
        (before the memory is freed: the thread holds it, and would fault it in again)."""
        self._stopping.set()
        self._done.wait()


def prefault_in_background(
    owners: Sequence[torch.Tensor], regions: Iterable[Region], touch: Callable[[], None]
) -> Prefault:
    """Fault in the pages of ``regions`` (memory of ``owners``, held until done) on a
    daemon thread, with their contents unchanged (``MADV_POPULATE_WRITE``: safe while the
    engine already writes them), so that a start does not wait for memory its first
    token does not need; the regions are iterated there too. The handle is set once they
    are in; :meth:`Prefault.stop` ends it early. Where the kernel lacks it, ``touch()``
    faults them in here instead."""
    handle = Prefault()
    madvise = _populate()
    if madvise is None:
        touch()
        handle._done.set()
        return handle

    def run() -> None:
        page = mmap.PAGESIZE
        try:
            for address, length in regions:
                if handle._stopping.is_set():
                    break
                start = address // page * page
                madvise(start, address + length - start, _MADV_POPULATE_WRITE)
        finally:
            del owners_held[:]
            handle._done.set()

    owners_held = list(owners)  # their memory stays mapped until the thread is done

    threading.Thread(target=run, daemon=True, name="enginecore-prefault").start()
    return handle
