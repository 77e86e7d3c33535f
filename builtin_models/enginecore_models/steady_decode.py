"""A decode step with the same requests as the last one, in a few array operations.

In steady decoding the scheduler sends the same running requests step after step, each
one token further, a few of them with a new block. Such a step's inputs follow from the
last one's: the requests' rows in the persistent batch and the block table, and their
order in the batch (the attention backend's, e.g. the CPU decode mirror's rows), are
those of the last step, and each request's position is its computed-token count. What
the last all-decode step looked up is kept here; the runner takes a step's inputs from
it when the scheduler's output shows that nothing else changed (:meth:`follows`): no
request added, finished or preempted, the same cached requests in the same order, one
token each, no drafts, no tokens from another pipeline stage.

Nothing here gives up the interpreter lock: under async scheduling the engine's thread
takes it at the first chance and the step waits until that thread lets go. Multi-
dimensional fancy indexing, ``take``, large allocations and tensors made or freed do;
one-dimensional indexing, small element-wise operations and slice assignments do not.
So the step's block table is kept in step order and appended to in place, the token
ids and slots are gathered with flat indices, and the step's index arrays are made once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import numpy as np

from enginecore.scheduler_output import SchedulerOutput
from enginecore_models.block_table import BlockTable
from enginecore_models.per_request import lookup_ints


@dataclass
class SteadyDecode:
    cached_req_ids: list[str]  # the scheduler's cached requests, in its order
    cached_rows: np.ndarray  # their persistent-batch rows
    order: list[str]  # the step's requests in batch order (the backend's)
    rows: np.ndarray  # the persistent-batch rows of ``order``
    kv_caches: Any  # the KV cache the rows were laid out for (a new one starts over)
    # The step's block table ([len(order), longest], as BlockTable.gather gives it)
    # and each request's index in ``order``.
    block_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int64))
    index_of: dict[str, int] = field(default_factory=dict)
    every: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # arange

    @classmethod
    def after(
        cls,
        so: SchedulerOutput,
        order: list[str],
        rows: np.ndarray,
        batch_row_of: dict[str, int],
        kv_caches: Any,
    ) -> SteadyDecode:
        """What a step of decodes only (``so``, no new request) leaves for the next."""
        cached = list(so.scheduled_cached_reqs.req_ids)
        steady = cls(
            cached_req_ids=cached,
            cached_rows=lookup_ints(batch_row_of, cached),
            order=order,
            rows=rows,
            kv_caches=kv_caches,
        )
        return steady

    def follows(self, so: SchedulerOutput) -> bool:
        """Whether ``so`` is this step again, each request one token further (new blocks
        allowed)."""
        cached = so.scheduled_cached_reqs
        n = len(self.order)
        return (
            not so.scheduled_new_reqs
            and not so.finished_req_ids
            and not so.preempted_req_ids
            and not so.scheduled_spec_decode_tokens
            # each scheduled request has at least one token: n of them, n tokens
            and so.total_num_scheduled_tokens == n == len(so.num_scheduled_tokens)
            and cached.req_ids == self.cached_req_ids
            and not any(cached.new_token_ids)
        )

    def lay_out(self, table: BlockTable) -> None:
        """The step's block table and indices for ``order`` (once per order)."""
        self.block_table = table.gather(self.order)
        self.index_of = dict(zip(self.order, range(len(self.order)), strict=True))
        self.every = np.arange(len(self.order))

    def reorder(self, order: list[str], batch_row_of: dict[str, int], table: BlockTable) -> None:
        """The backend put the requests in another order (its rows were rebuilt)."""
        self.order = order
        self.rows = lookup_ints(batch_row_of, order)
        self.lay_out(table)

    def append_blocks(
        self,
        table: BlockTable,
        req_ids: list[str],
        new_ids: list[list[int] | None],
    ) -> None:
        """The scheduler's new blocks (``new_ids`` follows ``req_ids``; None or empty:
        none), appended to ``table`` and to the step's block table in place."""
        for req_id, ids in zip(compress(req_ids, new_ids), filter(None, new_ids), strict=True):
            table.append(req_id, ids)
            end = int(table.lens[table.row_of[req_id]])
            if end > self.block_table.shape[1]:  # the longest row got longer: widen
                wider = np.zeros((len(self.order), end), np.int64)
                wider[:, : self.block_table.shape[1]] = self.block_table
                self.block_table = wider
            self.block_table[self.index_of[req_id], end - len(ids) : end] = ids

    def slots(self, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The KV cache slot of each request's position (``positions`` in ``order``)."""
        width = self.block_table.shape[1]
        index = self.every * width + positions // block_size
        slots: np.ndarray = self.block_table.reshape(-1)[index] * block_size
        slots += positions % block_size
        return slots
