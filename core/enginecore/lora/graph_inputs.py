"""What a CUDA graph of a decode step reads for LoRA, kept in place between replays.

A captured graph replays the kernels and tensors it was captured with. With LoRA those
are :class:`~enginecore.lora.dense_kernels.DenseLoRAKernels` over a persistent
``token_slots`` buffer (one entry per graph row): before each replay ``fill`` copies the
step's slots into it on the device (rows past the step: ``-1``, no adapter), and the
adapters' weights are already in their slots of the layers' stacks, written in place by
``LoRAManager.set_batch``. A step with no adapter token replays a graph captured
without LoRA (``fill`` returns False), so the base model pays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from enginecore.lora.dense_kernels import DenseLoRAKernels
from enginecore.lora.layer import LoRAStepState
from enginecore.lora.mapping import LoRABatchMapping


class LoRAGraphInputs:
    def __init__(self, state: LoRAStepState, max_rows: int, device: torch.device) -> None:
        self.state = state
        self.kernels = DenseLoRAKernels()
        self.token_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=device)

    @contextlib.contextmanager
    def capturing(self, rows: int, with_lora: bool) -> Iterator[None]:
        """While a graph of ``rows`` rows is captured: the layers compute their delta with
        the dense kernels over the persistent slots (``with_lora``), or skip LoRA."""
        kernels, mapping = self.state.kernels, self.state.mapping
        self.state.kernels = self.kernels
        self.state.mapping = (
            LoRABatchMapping(
                token_slots=self.token_slots[:rows],
                sorted_rows=self.token_slots[:0],
                segments=(),
                num_tokens=rows,
            )
            if with_lora
            else None
        )
        try:
            yield
        finally:
            self.state.kernels, self.state.mapping = kernels, mapping

    def fill(self, rows: int) -> bool:
        """Copy this step's token slots into the persistent buffer, padded to ``rows``
        with ``-1``; False when no token of the step has an adapter."""
        mapping = self.state.mapping
        if mapping is None:
            return False
        n = mapping.num_tokens
        self.token_slots[:n].copy_(mapping.token_slots, non_blocking=True)
        self.token_slots[n:rows].fill_(-1)
        return True
