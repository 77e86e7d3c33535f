"""The LoRA weights of one projection: a slot per loaded adapter, and the delta.

A projection with LoRA holds ``a_stack`` ``[max_loras, slices * max_lora_rank, in]`` and
``b_stack`` ``[max_loras, out, slices * max_lora_rank]`` on this rank. A fused projection
(QKV, gate/up) stacks its slices along the rank dimension, B block-diagonal, so the
whole projection's delta is one shrink and one expand. Each slice is sharded as the base
layer's rows are (column-parallel: B's rows; row-parallel: A's columns, the partial
delta joining the base output before the all-reduce). B is stored slot-minor
(``[out, max_loras, width]``, seen as ``[max_loras, out, width]``), so every slot's B
is one ``[out, max_loras * width]`` matrix without a copy (the dense kernels that CUDA
graphs replay multiply by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from enginecore.interfaces import LoRAKernels
from enginecore.lora.mapping import LoRABatchMapping


@dataclass
class LoRAStepState:
    """Shared by every LoRA layer of a model: the kernels, and the step's mapping (None
    while no token of the step has an adapter)."""

    kernels: LoRAKernels
    mapping: LoRABatchMapping | None = field(default=None)


class LoRALayer:
    """Attached to a :class:`enginecore.layers.LinearBase` as ``layer.lora``."""

    def __init__(
        self,
        layer: torch.nn.Module,
        state: LoRAStepState,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.state = state
        self.max_rank = max_rank
        # The layer kinds of enginecore.layers.linear, told apart by their sharding
        # attributes (this package sits below the layers and never imports them).
        self.merged = hasattr(layer, "local_sizes")
        self.row_parallel = hasattr(layer, "in_local")
        self.column_parallel = hasattr(layer, "out_local") and not self.merged
        in_local: int = layer.input_size  # type: ignore[assignment]
        out_local: int = layer.output_size  # type: ignore[assignment]
        self.slice_sizes: list[int] = (
            list(layer.local_sizes) if self.merged else [out_local]  # type: ignore[arg-type]
        )
        self.slice_offsets = [0]
        for size in self.slice_sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + size)
        width = len(self.slice_sizes) * max_rank
        self.a_stack = torch.zeros(max_loras, width, in_local, dtype=dtype, device=device)
        self.b_stack = torch.zeros(out_local, max_loras, width, dtype=dtype, device=device).permute(
            1, 0, 2
        )

    def set_slot(self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A, scaled B) per slice (None: that slice not targeted)
        into ``slot``, cut to this rank's shard."""
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        layer: Any = self.layer  # a column-, row- or merged parallel linear layer
        tp_rank: int = layer.parallel.tp_rank
        for i, pair in enumerate(slices):
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            if self.merged:
                start = layer.shard_start(i)
                b = b.narrow(0, start, self.slice_sizes[i])
            elif self.column_parallel:
                b = b.narrow(0, tp_rank * self.slice_sizes[0], self.slice_sizes[0])
            elif self.row_parallel:
                width = self.a_stack.shape[2]
                a = a.narrow(1, tp_rank * width, width)
            col = i * self.max_rank
            lo, hi = self.slice_offsets[i], self.slice_offsets[i + 1]
            self.a_stack[slot, col : col + rank].copy_(a)
            self.b_stack[slot, lo:hi, col : col + rank].copy_(b)

    @property
    def active(self) -> bool:
        return self.state.mapping is not None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each token's adapter delta."""
        mapping = self.state.mapping
        if mapping is None:
            return y
        kernels = self.state.kernels
        buf = kernels.shrink(x, self.a_stack, mapping)
        kernels.expand(y, buf, self.b_stack, mapping)
        return y
