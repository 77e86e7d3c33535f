"""GGUF's 32-element block formats (Q8_0, Q4_0, Q4_1) in the layout ``quant_kernels``
multiplies: per output row, the quantized values, and each block's scale ``d`` and
offset ``m`` (value = q d + m; Q4_0's q - 8 becomes m = -8 d, so one kernel serves both
4-bit formats). Q8_0, Q4_0 and Q4_1 keep ``d`` and ``m`` in float16, where the file's
values are exact: a decode step reads the file's bytes, not float32 scales.

GGUF stores a block as float16 ``d`` (and ``m`` for Q4_1) then the values; Q4 packs
element j in the low nibble of byte j and element j + 16 in its high nibble, which the
kernel unpacks as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from enginecore.layers.quantized import INT4_BLOCKS, int4_block_parts

BLOCK = 32
Q4_HALF_SCALES = 20  # ECQ_Q4_HALF in quant_kernels.c: 4-bit blocks, float16 d and m
Q4_0_HALF_SCALES = 21  # ECQ_Q4_0_HALF: float16 d, offsets -8 d formed from d (m not read)
Q8_HALF_SCALES = 22  # ECQ_Q8_HALF: 8-bit blocks, float16 d
# format -> (bytes per block, half-precision header values per block)
_LAYOUT = {"Q8_0": (2 + BLOCK, 1), "Q4_0": (2 + BLOCK // 2, 1), "Q4_1": (4 + BLOCK // 2, 2)}
FORMATS = tuple(_LAYOUT)


@dataclass
class BlockWeight:
    """A weight [out, in] in 32-element blocks: ``bits`` 4 (``qs`` [out, in/32, 16]
    uint8, two values a byte) or 8 (``qs`` [out, in] int8), ``d`` and ``m`` [out, in/32]
    float32 or float16 (``m`` zero for 8 bits). ``symmetric``: ``m`` is -8 ``d``
    (Q4_0), so the kernels form the offsets from ``d`` instead of reading ``m``."""

    bits: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    shape: tuple[int, int]
    symmetric: bool = False

    @cached_property
    def pointers(self) -> tuple[int, int, int]:
        """The addresses of ``qs``, ``d``, ``m`` (fixed once loaded) for the kernels."""
        return self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr()

    @property
    def kind(self) -> int:
        """What ``ecq_linear`` is told: 8, 4, ``Q8_HALF_SCALES``, ``Q4_HALF_SCALES`` or
        ``Q4_0_HALF_SCALES``."""
        if self.bits == 8 and self.d.dtype == torch.float16:
            return Q8_HALF_SCALES
        if self.bits == 4 and self.d.dtype == torch.float16:
            return Q4_0_HALF_SCALES if self.symmetric else Q4_HALF_SCALES
        return self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


def from_gguf(data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> BlockWeight:
    """Unpack GGUF's raw blocks ``data`` [out, bytes per row] of format ``fmt`` (or of
    ``INT4_BLOCKS``, a group-wise 4-bit checkpoint's weight)."""
    if fmt == INT4_BLOCKS:
        return BlockWeight(4, *int4_block_parts(data, shape), shape)
    if fmt not in _LAYOUT:
        raise ValueError(f"GGUF block format {fmt!r} is not one of {', '.join(FORMATS)}")
    out, k = shape
    if k % BLOCK:
        raise ValueError(f"a {fmt} weight needs a multiple of {BLOCK} inputs, not {k}")
    size, halves = _LAYOUT[fmt]
    nb = k // BLOCK
    blocks = data.reshape(out, nb, size)
    header = blocks[..., : 2 * halves].contiguous().view(torch.float16)
    d = header[..., 0].contiguous()
    payload = blocks[..., 2 * halves :]
    if fmt == "Q8_0":
        qs = payload.contiguous().view(torch.int8).reshape(out, k)
        return BlockWeight(8, qs, d, torch.zeros_like(d), shape)
    if fmt == "Q4_1":
        m = header[..., 1].contiguous()
    else:
        m = (-8.0 * d.float()).half()
        if not torch.equal(m.float(), -8.0 * d.float()):  # out of float16's range
            d, m = d.float(), -8.0 * d.float()
    symmetric = fmt == "Q4_0" and d.dtype == torch.float16
    return BlockWeight(4, payload.contiguous(), d, m, shape, symmetric)


def empty_blocks(fmt: str, shape: tuple[int, int], device: str = "cpu") -> BlockWeight:
    """An uninitialized :class:`BlockWeight` laid out as :func:`from_gguf` makes ``fmt``'s
    (float16 scales), to be filled (on the ``meta`` device: its layout only)."""
    out, k = shape
    nb = k // BLOCK
    if fmt == "Q8_0":
        qs = torch.empty(out, k, dtype=torch.int8, device=device)
    else:
        qs = torch.empty(out, nb, BLOCK // 2, dtype=torch.uint8, device=device)
    d, m = (torch.empty(out, nb, dtype=torch.float16, device=device) for _ in range(2))
    return BlockWeight(8 if fmt == "Q8_0" else 4, qs, d, m, shape, fmt == "Q4_0")


def quantize_q8(weight: torch.Tensor) -> BlockWeight:
    """A float weight [out, in] as Q8_0 blocks (symmetric, scale = max |w| / 127)."""
    out, k = weight.shape
    blocks = weight.detach().float().reshape(out, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    q = torch.round(blocks / torch.where(d > 0, d, 1.0).unsqueeze(-1)).clamp(-127, 127)
    qs = q.to(torch.int8).reshape(out, k).contiguous()
    return BlockWeight(8, qs, d.contiguous(), torch.zeros_like(d), (out, k))


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float32 weight [out, in] the blocks stand for."""
    out, k = weight.shape
    # One float32 tensor written in place: fresh memory is most of the cost at the size
    # of an embedding (a new tensor per step would fault its pages in again).
    values = torch.empty(out, k // BLOCK, BLOCK, dtype=torch.float32)
    if weight.bits == 8:
        values.copy_(weight.qs.reshape(out, k // BLOCK, BLOCK))
    else:
        torch.bitwise_and(weight.qs, 0x0F, out=values[..., : BLOCK // 2])
        torch.bitwise_right_shift(weight.qs, 4, out=values[..., BLOCK // 2 :])
    values.mul_(weight.d.float().unsqueeze(-1)).add_(weight.m.float().unsqueeze(-1))
    return values.reshape(out, k)
