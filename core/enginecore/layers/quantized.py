"""A checkpoint tensor handed over still quantized, for a linear method that keeps it so."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    """A weight in a file's block format: ``data`` holds each output row's blocks as raw
    bytes ([rows, bytes per row], uint8), ``shape`` the logical [out, in] float shape and
    ``format`` the block format's name (GGUF's type names: ``Q4_0``, ``Q4_1``, ``Q8_0``).
    Row slicing and row permutation work on ``data`` as on the float weight. ``source``
    names where the rows come from in the checkpoint (the tensor, then each row range
    taken), or is empty: a linear method may key what it prepares from them by it."""

    data: torch.Tensor
    format: str
    shape: tuple[int, int]
    source: str = ""

    def stored_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows as stored and, where ``data`` reorders them, the stored row each
        output row is (None: in order), so that a preparation pass can read them in place
        rather than have ``data`` copy them."""
        return self.data, None

    def rows(self, start: int, length: int) -> QuantizedTensor:
        """Output rows ``start`` to ``start + length`` (a column-parallel shard)."""
        source = f"{self.source}[{start}:{start + length}]" if self.source else ""
        return QuantizedTensor(
            self.data.narrow(0, start, length), self.format, (length, self.shape[1]), source
        )


# 4-bit values in blocks of 32 with a float32 scale d and offset m each (value = q d + m):
# a group-wise 4-bit checkpoint (AWQ, GPTQ) handed over in one byte layout. A block's 24
# bytes: 16 of values (byte j: value j in the low nibble, value j + 16 in the high one),
# then d and m.
INT4_BLOCKS = "INT4_B32"
_BLOCK = 32


def int4_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> QuantizedTensor:
    """``q`` [out, in] values 0..15, ``d`` and ``m`` [out, in/32] as an ``INT4_BLOCKS``
    tensor."""
    out, k = q.shape
    halves = q.reshape(out, k // _BLOCK, 2, _BLOCK // 2).to(torch.uint8)
    values = halves[..., 0, :] | (halves[..., 1, :] << 4)
    header = torch.stack([d.float(), m.float()], dim=-1).contiguous().view(torch.uint8)
    data = torch.cat([values, header], dim=-1).reshape(out, -1)
    return QuantizedTensor(data, INT4_BLOCKS, (out, k))


def int4_block_parts(
    data: torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed values [out, in/32, 16] uint8, d, m [out, in/32] float32) of ``data``."""
    out, k = shape
    blocks = data.reshape(out, k // _BLOCK, _BLOCK // 2 + 8)
    header = blocks[..., _BLOCK // 2 :].contiguous().view(torch.float32)
    return (
        blocks[..., : _BLOCK // 2].contiguous(),
        header[..., 0].contiguous(),
        header[..., 1].contiguous(),
    )
