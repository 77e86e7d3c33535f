"""A step's tokens grouped by LoRA slot, built once per step and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRABatchMapping:
    """Which adapter slot each token of the step uses (see
    :class:`enginecore.interfaces.LoRAKernels`)."""

    token_slots: torch.Tensor  # [T] int64, -1: no adapter
    sorted_rows: torch.Tensor  # [N] int64: rows with an adapter, grouped by slot
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) ranges of sorted_rows
    num_tokens: int

    @property
    def single_slot(self) -> int | None:
        """The one slot every token uses, or None (then rows must be gathered)."""
        if len(self.segments) == 1 and self.segments[0][2] == self.num_tokens:
            return self.segments[0][0]
        return None


def build_mapping(
    request_slots: np.ndarray, query_lens: np.ndarray, device: torch.device
) -> LoRABatchMapping | None:
    """The mapping for requests (in batch order) with these slots (-1: none) and query
    lengths; None when no token has an adapter (the layers then skip LoRA entirely)."""
    if not (request_slots >= 0).any():
        return None
    token_slots = np.repeat(request_slots.astype(np.int64), query_lens)
    rows = np.flatnonzero(token_slots >= 0)
    order = np.argsort(token_slots[rows], kind="stable")
    rows = rows[order]
    slots_sorted = token_slots[rows]
    bounds = np.flatnonzero(np.diff(slots_sorted)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(rows)]))
    segments = tuple(
        (int(slots_sorted[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)
    )
    return LoRABatchMapping(
        token_slots=torch.from_numpy(token_slots).to(device),
        sorted_rows=torch.from_numpy(rows).to(device),
        segments=segments,
        num_tokens=len(token_slots),
    )
