"""A checkpoint tensor handed over still quantized, for a linear method that keeps it so."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    """A weight in a file's block format: ``data`` holds each output row's blocks as raw
    bytes ([rows, bytes per row], uint8), ``shape`` the logical [out, in] float shape and
    ``format`` the block format's name (GGUF's type names: ``Q4_0``, ``Q4_1``, ``Q8_0``).
    Row slicing and row permutation work on ``data`` as on the float weight."""

    data: torch.Tensor
    format: str
    shape: tuple[int, int]

    def rows(self, start: int, length: int) -> QuantizedTensor:
        """Output rows ``start`` to ``start + length`` (a column-parallel shard)."""
        return QuantizedTensor(
            self.data.narrow(0, start, length), self.format, (length, self.shape[1])
        )
