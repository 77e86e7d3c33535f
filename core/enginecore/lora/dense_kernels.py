"""LoRA kernels a CUDA graph can replay: fixed shapes, no host reads.

Every token's delta is computed against all ``max_loras`` slots at once and masked to
its own: shrink is one matmul of the tokens by every slot's A (``[T, slots * R]``),
masked by a one-hot of each token's slot and summed to ``[T, R]``; expand spreads that
back to ``[T, slots * R]`` under the same mask and multiplies by every slot's B. The
only input that changes between steps is ``mapping.token_slots`` (``-1``: no adapter,
an all-zero mask), read on the device: a graph captured over a persistent slot buffer
replays any mix of adapters. The extra work over the grouped kernels is the other
slots' share of two thin matmuls (rank-wide), small beside the base projection.
"""

from __future__ import annotations

import torch

from enginecore.interfaces import LoRAKernels
from enginecore.lora.mapping import LoRABatchMapping


def _slot_mask(token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, slots]``: 1 where the token uses the slot (none for ``-1``)."""
    slots = torch.arange(num_slots, device=token_slots.device)
    return (token_slots[:, None] == slots[None, :]).to(dtype)


class DenseLoRAKernels(LoRAKernels):
    name = "dense"

    def shrink(
        self, x: torch.Tensor, a_stack: torch.Tensor, mapping: LoRABatchMapping
    ) -> torch.Tensor:
        num_slots, width, in_dim = a_stack.shape
        every = x @ a_stack.reshape(num_slots * width, in_dim).t()  # [T, slots * R]
        mask = _slot_mask(mapping.token_slots, num_slots, every.dtype)
        return (every.view(-1, num_slots, width) * mask[:, :, None]).sum(1).float()

    def expand(
        self,
        y: torch.Tensor,
        buf: torch.Tensor,
        b_stack: torch.Tensor,
        mapping: LoRABatchMapping,
    ) -> None:
        num_slots, out_dim, width = b_stack.shape
        mask = _slot_mask(mapping.token_slots, num_slots, b_stack.dtype)
        wide = (buf.to(b_stack.dtype)[:, None, :] * mask[:, :, None]).reshape(-1, num_slots * width)
        # [out, slots * R]: a view when the stack is kept slot-minor (LoRALayer does).
        b_flat = b_stack.permute(1, 0, 2).reshape(out_dim, num_slots * width)
        y += (wide @ b_flat.t()).to(y.dtype)
