"""GGUF's K-quant formats (Q4_K, Q5_K, Q6_K) unpacked to the layouts the ``gguf`` linear
method multiplies, with the same values.

A K-quant super-block holds 256 values. Q4_K and Q5_K: float16 ``d`` and ``dmin``, twelve
bytes of 6-bit scales and mins for eight sub-blocks of 32 (value = d sc q - dmin mn),
then the values (4 bits, Q5_K with a fifth bit in ``qh``). Q6_K: the values' low 4 bits,
their high 2 bits, sixteen signed 8-bit scales (one per 16 values), float16 ``d``
(value = d sc (q - 32)). Layouts as ggml's ``block_q4_K``, ``block_q5_K``, ``block_q6_K``.

Q4_K becomes 4-bit :class:`BlockWeight` blocks of 32 (scale d sc, offset -dmin mn; a
float16 times a 6-bit integer is exact in float32), served by ``quant_kernels``. Q5_K
and Q6_K become :class:`SubBlockWeight`: their values at the file's width (the low 4
bits two a byte, the 5th and 6th bits as bit planes) with float32 scales, served by
``kquant_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore.builtin_cpu.gguf_blocks import BLOCK, BlockWeight

SUPER = 256
HALF = 16
_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
FORMATS = tuple(_BYTES)


@dataclass
class SubBlockWeight:
    """A Q5_K (``bits`` 5) or Q6_K (``bits`` 6) weight [out, in] at the file's value width.

    ``qs`` [out, in/64 * (32 + 8 (bits - 4))] uint8: per pair of 32-value blocks, 32 bytes
    of low 4 bits (byte j: value j of the first block low, of the second high), then each
    block's high bits as little-endian 32-bit words, bit i for value i (the 5th bit; for
    Q6_K then the 6th). ``d``: a float32 scale per 32 values (Q5_K, [out, in/32]) or per
    16 (Q6_K, [out, in/16]); ``m``: Q5_K's offset per 32 ([out, in/32]), empty for Q6_K.
    Value = q d + m (Q5_K), (q - 32) d (Q6_K)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    shape: tuple[int, int]
    bits: int

    @property
    def kind(self) -> int:
        """The kernels' name for this layout: the bits a value."""
        return self.bits


def _halves(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of ``packed`` [..., 12] (ggml's get_scale_min_k4):
    bytes 0-3 and 4-7 hold sub-blocks 0-3's scales and mins in their low 6 bits and the
    top 2 bits of sub-blocks 4-7's; bytes 8-11 hold the low 4 bits of those."""
    s = packed.to(torch.int32)
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([low & 63, (top & 15) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """4-bit values of ``qs`` [..., chunks, 32]: each chunk of 32 bytes holds 64 values,
    the first 32 in the low nibbles -> [..., chunks * 64]."""
    pair = torch.stack([qs & 15, qs >> 4], dim=-2)
    return pair.flatten(-3)


def _k_values(data: torch.Tensor, fmt: str, shape: tuple[int, int]):
    """(q [out, in] int16 values as stored, d [out, in/16 or in/32], m (Q6_K: empty)) of
    a K-quant tensor; Q6_K's values stand for q - 32."""
    out, k = shape
    if k % SUPER:
        raise ValueError(f"a {fmt} weight needs a multiple of {SUPER} inputs, not {k}")
    blocks = data.reshape(out, k // SUPER, _BYTES[fmt])
    if fmt == "Q6_K":
        # Each half of 128 values: ql's 64 bytes hold values 0-63 (low nibbles) and 64-127
        # (high), qh's 32 bytes hold the top 2 bits of values l, 32 + l, 64 + l, 96 + l.
        ql = blocks[..., :128].reshape(out, -1, 2, 64).to(torch.int16)
        qh = blocks[..., 128:192].reshape(out, -1, 2, 32).to(torch.int16)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        d = _halves(blocks[..., 208:210])
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)
        q = _nibbles(ql).reshape(out, k) | (high.reshape(out, k) << 4)
        return q, (d * scales).reshape(out, k // HALF), torch.zeros(out, 0)
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
    scales, mins = _scales_and_mins(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(out, -1, 4, 32).to(torch.int16)
    q = _nibbles(qs).reshape(out, -1, 8, 32)
    if fmt == "Q5_K":
        qh = blocks[..., 16:48].to(torch.int16)  # bit i of byte l: sub-block i, value l
        high = torch.stack([(qh >> i) & 1 for i in range(8)], dim=-2)
        q = q | (high << 4)
    return q.reshape(out, k), (d * scales).reshape(out, -1), (-(dmin * mins)).reshape(out, -1)


def from_gguf(data: torch.Tensor, fmt: str, shape: tuple[int, int]):
    """Unpack GGUF's raw K-quant super-blocks ``data`` [out, bytes per row]."""
    if fmt not in _BYTES:
        raise ValueError(f"GGUF K-quant format {fmt!r} is not one of {', '.join(FORMATS)}")
    q, d, m = _k_values(data, fmt, shape)
    if fmt == "Q4_K":
        return four_bit_blocks(q, d, m, shape)
    bits = 6 if fmt == "Q6_K" else 5
    return SubBlockWeight(_packed(q, bits), d.contiguous(), m.contiguous(), shape, bits)


def _packed(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Values ``q`` [out, in] in 0..2^bits - 1 as :class:`SubBlockWeight`'s ``qs``."""
    out, k = q.shape
    pairs = q.reshape(out, k // (2 * BLOCK), 2, BLOCK).to(torch.int32)
    low = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).to(torch.uint8)
    # a plane's word as its four little-endian bytes: byte t holds values 8t..8t+7
    weights = torch.ones(8, dtype=torch.int32) << torch.arange(8, dtype=torch.int32)
    planes = [
        (((pairs >> bit) & 1).reshape(*pairs.shape[:-1], 4, 8) * weights).sum(-1)
        for bit in range(4, bits)
    ]
    words = torch.stack(planes, dim=-2)  # [out, pairs, 2 blocks, planes, 4 bytes]
    high = words.to(torch.uint8).reshape(out, k // (2 * BLOCK), -1)
    return torch.cat([low, high], dim=-1).reshape(out, -1).contiguous()


def values(weight: SubBlockWeight) -> torch.Tensor:
    """The file's values [out, in] (int16) of ``weight``, Q6_K's centred (q - 32)."""
    out, k = weight.shape
    planes = weight.bits - 4
    records = weight.qs.reshape(out, k // (2 * BLOCK), 2 * HALF + 8 * planes)
    low = records[..., : 2 * HALF].to(torch.int16)
    q = torch.stack([low & 15, low >> 4], dim=-2)  # [out, pairs, 2 blocks, 32]
    words = records[..., 2 * HALF :].contiguous().view(torch.int32).reshape(out, -1, 2, planes)
    shifts = torch.arange(BLOCK, dtype=torch.int32)
    for plane in range(planes):
        q = q | ((((words[..., plane, None] >> shifts) & 1) << (4 + plane)).to(torch.int16))
    q = q.reshape(out, k)
    return q - 32 if weight.bits == 6 else q


def four_bit_blocks(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, shape: tuple[int, int]
) -> BlockWeight:
    """Values ``q`` [out, in] in 0..15 with a scale ``d`` and offset ``m`` per block of 32
    as the 4-bit :class:`BlockWeight` layout (byte j: value j low, value j + 16 high)."""
    out, k = shape
    blocks = q.reshape(out, k // BLOCK, 2, BLOCK // 2).to(torch.uint8)
    qs = (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).contiguous()
    return BlockWeight(4, qs, d.float().contiguous(), m.float().contiguous(), shape)


def dequantize(weight: SubBlockWeight) -> torch.Tensor:
    """The float32 weight [out, in] of :class:`SubBlockWeight` ``weight``."""
    out, k = weight.shape
    per_scale = BLOCK if weight.bits == 5 else HALF
    values_ = values(weight).float().reshape(out, k // per_scale, per_scale)
    scaled = (values_ * weight.d.unsqueeze(-1)).reshape(out, k)
    if weight.bits == 6:
        return scaled
    return (scaled.reshape(out, k // BLOCK, BLOCK) + weight.m.unsqueeze(-1)).reshape(out, k)
