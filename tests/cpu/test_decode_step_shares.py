"""How the fused decode step cuts a phase among its threads (``ecd_share`` in
``decode_step.c``): each take is half of what is left on two threads, so a small model's
phase is a handful of chunks; every unit is still computed by the same code whichever
thread takes it (the bits on any number of threads: ``test_fused_decode.py``)."""

from __future__ import annotations

import ctypes
import math

import pytest

from enginecore_cpu import cpu_kernels, decode_step

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


def _share() -> ctypes._CFuncPtr:
    share = decode_step._load().ecd_share
    share.argtypes = [ctypes.c_int64, ctypes.c_int]
    share.restype = ctypes.c_int64
    return share


def _takes(count: int, threads: int) -> list[int]:
    """The chunks' sizes of a phase of ``count`` units, taken one after another."""
    share, left, takes = _share(), count, []
    while left > 0:
        take = min(left, share(left, threads))
        takes.append(take)
        left -= take
    return takes


def test_a_thread_takes_half_of_what_is_left_on_two_threads() -> None:
    share = _share()
    assert share(60, 2) == 30
    assert share(96, 2) == 48
    assert share(1, 2) == 1  # never nothing
    assert share(96, 1) == 96  # one thread takes the whole phase in one call


# The demo GGUF's phases on two threads, in units of 16 rows: down and O (576 rows), QKV
# (960), gate/up (1,536 columns of each); and a 1.7B model's gate/up (8,192).
@pytest.mark.parametrize("count", [36, 60, 96, 512])
def test_a_phase_is_a_few_chunks(count: int) -> None:
    takes = _takes(count, 2)
    assert sum(takes) == count
    assert len(takes) <= 2 * math.log2(count) + 2
    assert takes[0] == count // 2
