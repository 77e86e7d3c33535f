"""The reference :class:`LoRAKernels`: one matmul pair per adapter in the batch.

Tokens are gathered by slot (``mapping.sorted_rows``), so a projection costs one
shrink and one expand per distinct adapter in the step, never one per request.
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
        buf = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
        for slot, start, end in mapping.segments:
            rows = mapping.sorted_rows[start:end]
            buf[rows] = (x.index_select(0, rows) @ a_stack[slot].t()).float()
        return buf

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
        for slot, start, end in mapping.segments:
            rows = mapping.sorted_rows[start:end]
            delta = buf.index_select(0, rows).to(b_stack.dtype) @ b_stack[slot].t()
            y.index_add_(0, rows, delta.to(y.dtype))
