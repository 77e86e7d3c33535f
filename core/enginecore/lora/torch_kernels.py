"""The reference :class:`LoRAKernels`: one matmul pair per adapter in the batch.

The adapter rows are gathered once in slot order (``mapping.sorted_rows``), each
adapter's rows are then one contiguous slice multiplied in place, and the deltas are
scattered back once: a projection costs a few gathers plus one shrink and one expand
per distinct adapter in the step, never anything per request.
"""

from __future__ import annotations

import torch

from enginecore.interfaces import LoRAKernels
from enginecore.lora.mapping import LoRABatchMapping


class TorchLoRAKernels(LoRAKernels):
    name = "torch"

    def shrink(
        self, x: torch.Tensor, a_stack: torch.Tensor, mapping: LoRABatchMapping
    ) -> torch.Tensor:
        slot = mapping.single_slot
        if slot is not None:
            return (x @ a_stack[slot].t()).float()
        rows = mapping.sorted_rows
        xs = x.index_select(0, rows)
        grouped = torch.empty(xs.shape[0], a_stack.shape[1], dtype=x.dtype, device=x.device)
        for slot, start, end in mapping.segments:
            torch.matmul(xs[start:end], a_stack[slot].t(), out=grouped[start:end])
        buf = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
        return buf.index_copy_(0, rows, grouped.float())

    def expand(
        self,
        y: torch.Tensor,
        buf: torch.Tensor,
        b_stack: torch.Tensor,
        mapping: LoRABatchMapping,
    ) -> None:
        slot = mapping.single_slot
        if slot is not None:
            y += (buf.to(b_stack.dtype) @ b_stack[slot].t()).to(y.dtype)
            return
        rows = mapping.sorted_rows
        bs = buf.index_select(0, rows).to(b_stack.dtype)
        delta = torch.empty(bs.shape[0], b_stack.shape[1], dtype=b_stack.dtype, device=y.device)
        for slot, start, end in mapping.segments:
            torch.matmul(bs[start:end], b_stack[slot].t(), out=delta[start:end])
        y.index_add_(0, rows, delta.to(y.dtype))
