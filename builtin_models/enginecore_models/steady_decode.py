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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from enginecore.scheduler_output import SchedulerOutput
from enginecore_models.per_request import lookup_ints


@dataclass
class SteadyDecode:
    cached_req_ids: list[str]  # the scheduler's cached requests, in its order
    cached_rows: np.ndarray  # their persistent-batch rows
    order: list[str]  # the step's requests in batch order (the backend's)
    rows: np.ndarray  # the persistent-batch rows of ``order``
    table_rows: np.ndarray  # the block-table rows of ``order``
    kv_caches: Any  # the KV cache the rows were laid out for (a new one starts over)

    @classmethod
    def after(
        cls,
        so: SchedulerOutput,
        order: list[str],
        rows: np.ndarray,
        batch_row_of: dict[str, int],
        table_row_of: dict[str, int],
        kv_caches: Any,
    ) -> SteadyDecode:
        """What a step of decodes only (``so``, no new request) leaves for the next."""
        cached = list(so.scheduled_cached_reqs.req_ids)
        return cls(
            cached_req_ids=cached,
            cached_rows=lookup_ints(batch_row_of, cached),
            order=order,
            rows=rows,
            table_rows=lookup_ints(table_row_of, order),
            kv_caches=kv_caches,
        )

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

    def reorder(
        self, order: list[str], batch_row_of: dict[str, int], table_row_of: dict[str, int]
    ) -> None:
        """The backend put the requests in another order (its rows were rebuilt)."""
        self.order = order
        self.rows = lookup_ints(batch_row_of, order)
        self.table_rows = lookup_ints(table_row_of, order)
