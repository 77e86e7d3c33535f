"""The waiting queue, kept in policy order (a heap on ``policy.sort_key``)."""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from enginecore.errors import PluginContractError

if TYPE_CHECKING:
    from enginecore.request import Request


class WaitingQueue:
    """Requests waiting for admission; the smallest sort key comes out first.

    A preempted request is pushed back with its original key, so under FCFS it lands
    at the front again. Equal keys keep insertion order (a counter breaks ties, so
    requests themselves are never compared).
    """

    def __init__(self, sort_key: Callable[[Request], Any]) -> None:
        self._sort_key = sort_key
        self._heap: list[tuple[Any, int, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        entry = (self._sort_key(request), next(self._counter), request)
        try:
            heapq.heappush(self._heap, entry)
        except TypeError as exc:  # the policy's keys cannot be ordered against each other
            self._heap = [e for e in self._heap if e is not entry]
            with contextlib.suppress(TypeError):
                heapq.heapify(self._heap)
            owner = getattr(self._sort_key, "__qualname__", repr(self._sort_key))
            raise PluginContractError(
                f"scheduling policy {owner} returned {entry[0]!r}, which cannot be ordered "
                f"against the other waiting requests' keys ({exc}); sort_key must return "
                "mutually comparable values (numbers, strings or tuples of them)",
                origin=self._sort_key,
            ) from exc

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove_many(self, object_ids: set[int]) -> None:
        """Drop the requests whose ``id()`` is given (aborts: rare, so O(n) is fine)."""
        heap = [e for e in self._heap if id(e[2]) not in object_ids]
        if len(heap) != len(self._heap):
            heapq.heapify(heap)
            self._heap = heap

    def view(self) -> Sequence[Request]:
        """The waiting requests, read-only and unordered, without a copy."""
        return _HeapView(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return (e[2] for e in sorted(self._heap, key=lambda e: (e[0], e[1])))


class _HeapView(Sequence["Request"]):
    """The requests of a heap of ``(key, counter, request)`` entries, in heap order."""

    __slots__ = ("_heap",)

    def __init__(self, heap: list[tuple[Any, int, Request]]) -> None:
        self._heap = heap

    def __len__(self) -> int:
        return len(self._heap)

    @overload
    def __getitem__(self, index: int) -> Request: ...
    @overload
    def __getitem__(self, index: slice) -> list[Request]: ...
    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        if isinstance(index, slice):
            return [entry[2] for entry in self._heap[index]]
        return self._heap[index][2]
