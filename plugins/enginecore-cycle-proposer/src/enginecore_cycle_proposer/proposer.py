"""Drafts that continue a loop the text is already in.

If the last ``2 * p`` tokens are the same ``p`` tokens twice (for the smallest period
``p <= MAX_PERIOD``), the text is guessed to keep cycling, and the next tokens of the
cycle are proposed — as many as asked, even beyond what the text holds (where n-gram
lookup stops at the end of the text). Lists, tables, repeated boilerplate and the loops
small models fall into are where it hits.
"""

from __future__ import annotations

import numpy as np

from enginecore.interfaces import SpecDecodeProposer

MAX_PERIOD = 16


class CycleProposer(SpecDecodeProposer):
    def propose(self, token_ids: np.ndarray, max_num_drafts: int) -> list[int]:
        n = len(token_ids)
        for period in range(1, min(MAX_PERIOD, n // 2) + 1):
            tail = token_ids[n - period :]
            if np.array_equal(token_ids[n - 2 * period : n - period], tail):
                reps = -(-max_num_drafts // period)
                return np.tile(tail, reps)[:max_num_drafts].tolist()
        return []
