"""Every running request's block ids, kept in persistent rows of one array.

The scheduler sends only each step's new blocks; appending them to a request's row and
gathering the scheduled rows costs O(requests) per step, where rebuilding the table
from per-request lists costs O(blocks) (benchmarks/RESULTS.md, "Other measurements
behind the code").
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np


class BlockTable:
    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.table = np.zeros((rows, cols), dtype=np.int64)
        self.lens = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))

    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.table.shape
        new_rows, new_cols = max(rows, old_rows), max(cols, old_cols)
        if (new_rows, new_cols) == (old_rows, old_cols):
            return
        table = np.zeros((new_rows, new_cols), dtype=np.int64)
        table[:old_rows, :old_cols] = self.table
        lens = np.zeros(new_rows, dtype=np.int64)
        lens[:old_rows] = self.lens
        self.table, self.lens = table, lens
        self.free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self.free_rows

    def add(self, req_id: str, block_ids: Sequence[int]) -> None:
        if req_id in self.row_of:
            self.remove(req_id)
        if not self.free_rows:
            self._grow(2 * self.table.shape[0], 0)
        row = self.free_rows.pop()
        self.row_of[req_id] = row
        self.lens[row] = 0
        self.table[row] = 0  # padding reads block 0, never a previous request's blocks
        self.append(req_id, block_ids)

    def append(self, req_id: str, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        start = int(self.lens[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(0, max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids
        self.lens[row] = end

    def append_each(self, req_ids: Sequence[str], new_ids: Sequence[Sequence[int] | None]) -> None:
        """``append`` for each request that has new blocks: ``new_ids`` follows
        ``req_ids`` (it may be shorter; None or empty: none). Only those requests are
        visited in Python (most steps: a few, or none)."""
        for req_id, ids in zip(compress(req_ids, new_ids), filter(None, new_ids), strict=True):
            self.append(req_id, ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def block_ids(self, req_id: str) -> np.ndarray:
        row = self.row_of[req_id]
        return self.table[row, : self.lens[row]]

    def slots(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The KV cache slot of ``positions[i]`` of the request in table row ``rows[i]``
        (one flat gather from the table)."""
        index = rows * self.table.shape[1] + positions // block_size
        slots: np.ndarray = self.table.ravel().take(index) * block_size + positions % block_size
        return slots

    def gather(self, req_ids: Sequence[str]) -> np.ndarray:
        """[len(req_ids), longest] block ids of these requests, in this order, 0-padded."""
        rows = np.fromiter(map(self.row_of.__getitem__, req_ids), np.int64, count=len(req_ids))
        width = int(self.lens[rows].max()) if len(rows) else 0
        return self.table[rows, : max(width, 1)]
