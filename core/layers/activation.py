"""Gated activations. ``silu(gate) * up`` may run as a backend's fused kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.layers.fused_ops import NO_FUSED_OPS


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``x`` = [gate | up] (the last dimension split in halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_ops = NO_FUSED_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fused_ops.silu_and_mul(x)
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one fewer temporary
