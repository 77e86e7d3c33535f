"""Reads and writes of one attribute across a whole batch of requests, iterated in C.

A decode step touches every running request a few times (its computed-token count, its
row, its token lists). Written as Python loops, those passes cost about a microsecond
per request each and hold the interpreter lock throughout, which under async
scheduling is also time the engine's thread waits. ``map`` over ``attrgetter``,
``setattr`` and bound ``dict``/``list`` methods runs the same passes without a Python
frame per request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, TypeVar

import numpy as np

K = TypeVar("K")
V = TypeVar("V")


def values_of(objects: Iterable[Any], attr: str) -> list[Any]:
    """``[o.<attr> for o in objects]``."""
    return list(map(attrgetter(attr), objects))


def any_set(objects: Iterable[Any], attr: str) -> bool:
    """Whether any object's ``attr`` is not None."""
    return any(map(is_not, map(attrgetter(attr), objects), repeat(None)))


def append_each(lists: Iterable[list[Any]], values: Iterable[Any]) -> None:
    """``lst.append(v)`` for each pair."""
    deque(map(list.append, lists, values), maxlen=0)


def lookup(mapping: Mapping[K, V], keys: Iterable[K]) -> list[V]:
    """``[mapping[k] for k in keys]`` (KeyError for a missing key)."""
    return list(map(mapping.__getitem__, keys))


def lookup_ints(mapping: Mapping[K, int], keys: Sequence[K]) -> np.ndarray:
    """``mapping[k]`` of each key as an int64 array (KeyError for a missing key)."""
    return np.fromiter(map(mapping.__getitem__, keys), np.int64, count=len(keys))
