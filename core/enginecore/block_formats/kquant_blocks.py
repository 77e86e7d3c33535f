"""GGUF's K-quant formats (Q4_K, Q5_K, Q6_K) unpacked to the layouts the ``gguf`` linear
method multiplies, with the same values and the file's scales.

A K-quant super-block holds 256 values. Q4_K and Q5_K: float16 ``d`` and ``dmin``, twelve
bytes of 6-bit scales and mins for eight sub-blocks of 32 (value = d sc q - dmin mn),
then the values (4 bits, Q5_K with a fifth bit in ``qh``). Q6_K: the values' low 4 bits,
their high 2 bits, sixteen signed 8-bit scales (one per 16 values), float16 ``d``
(value = d sc (q - 32)). Layouts as ggml's ``block_q4_K``, ``block_q5_K``, ``block_q6_K``.

A :class:`KQuantWeight` keeps each super-block's scales as the file has them (its
``scales`` bytes: Q4_K / Q5_K ``d``, ``dmin`` and the twelve packed bytes, Q6_K the sixteen
scales and ``d``), so it holds the file's bits a value: 4.5 (Q4_K), 5.5 (Q5_K), 6.5625
(Q6_K). The kernels form d sc and -(dmin mn) in float32 as they read them: a float16
times a 6- or 8-bit integer is exact in float32, so these are the float32 scales and
offsets of :func:`float_scales` exactly. Q4_K's values are 4-bit blocks of 32 as
:class:`BlockWeight`'s, multiplied by ``quant_kernels`` (kind ``Q4_K_KIND``); Q5_K's and
Q6_K's are at the file's width (the low 4 bits two a byte, the 5th and 6th bits as bit
planes), multiplied by ``kquant_kernels``. Q5_K and Q6_K have a second layout of their
high bits, ``PACKED``: Q5_K's a bit a value, eight values a byte, Q6_K's two bits a value,
four values a byte, as the file's ``qh`` packs them, which CPUs without AVX-512's byte
masks or GFNI unpack with a shift and an and per 32 values; a weight names its layout
(``high``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from enginecore.block_formats.gguf_blocks import BLOCK, BlockWeight

SUPER = 256
HALF = 16
_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
FORMATS = tuple(_BYTES)
# Bytes of scales a super-block: where they lie in the file's, and how many.
_SCALES_AT = {"Q4_K": (0, 16), "Q5_K": (0, 16), "Q6_K": (192, 18)}
Q4_K_KIND = 24  # ECQ_Q4_K in quant_kernels.c: 4-bit blocks of 32, scales per super-block
# The layouts of a pair record's high bits (``KQuantWeight.high``).
PLANES = "planes"
PACKED = "packed"
HIGH_LAYOUTS = (PLANES, PACKED)


@dataclass
class KQuantWeight:
    """A Q4_K, Q5_K or Q6_K weight [out, in] with the file's scales.

    ``scales`` [out, in/256 * 16 (Q4_K, Q5_K) or 18 (Q6_K)] uint8: each super-block's
    scale bytes as the file stores them. ``qs``: Q4_K [out, in/32, 16] uint8 (byte j of a
    block of 32: value j low, value j + 16 high); Q5_K / Q6_K [out, in/64 * (32 +
    8 (bits - 4))] uint8: per pair of 32-value blocks, 32 bytes of low 4 bits (byte j:
    value j of the first block low, of the second high), then each block's high bits as
    little-endian 32-bit words, bit i for value i (the 5th bit; for Q6_K then the 6th).
    Q5_K with ``high`` ``PACKED``: the record's last 8 bytes hold a bit a value instead,
    byte b the 5th bits of the first block's values b, 8 + b, 16 + b, 24 + b (bits 4-7)
    and of the second block's (bits 0-3): one 64-bit shift of the 8 bytes, by q for values
    8q.., puts the first block's in bit 4 of each value's byte and the second's in bit 0.
    Q6_K with ``high`` ``PACKED``: the record's last 16 bytes hold two bits a value
    instead, byte t the 5th and 6th bits of the second block's values t (bits 0-1) and
    t + 16 (bits 2-3) and of the first block's values t (bits 4-5) and t + 16 (bits 6-7):
    one 32-bit shift of the 16 bytes, by 0 for values 0-15 and 2 for 16-31, puts the first
    block's in bits 4-5 of each value's byte and the second's in bits 0-1."""

    fmt: str
    qs: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    high: str = PLANES

    @property
    def bits(self) -> int:
        """Bits of each value (4, 5, 6), the scales aside."""
        return int(self.fmt[1])

    @property
    def kind(self) -> int:
        """The kernels' name for this layout: ``ecq_linear``'s ``Q4_K_KIND`` for Q4_K,
        ``eck_gemm_k``'s bits a value for Q5_K and Q6_K."""
        return Q4_K_KIND if self.fmt == "Q4_K" else self.bits

    @cached_property
    def pointers(self) -> tuple[int, int, int]:
        """The addresses the kernels take (values, scales, no offsets) once loaded."""
        return self.qs.data_ptr(), self.scales.data_ptr(), 0

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes


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


def _float_scales(fmt: str, header: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d sc, -(dmin mn)) in float32 of the scale bytes ``header`` [out, super-blocks,
    bytes]: [out, in/32] each, or for Q6_K ([out, in/16], empty)."""
    out = header.shape[0]
    if fmt == "Q6_K":
        scales = header[..., :16].contiguous().view(torch.int8).float()
        d = _halves(header[..., 16:18])
        return (d * scales).reshape(out, -1), torch.zeros(out, 0)
    d, dmin = _halves(header[..., 0:2]), _halves(header[..., 2:4])
    scales, mins = _scales_and_mins(header[..., 4:16])
    return (d * scales).reshape(out, -1), (-(dmin * mins)).reshape(out, -1)


def float_scales(weight: KQuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scale of each sub-block of ``weight`` (per 32 values, Q6_K per 16) and
    its offset (per 32; empty for Q6_K), as the kernels form them."""
    out, k = weight.shape
    return _float_scales(weight.fmt, weight.scales.reshape(out, k // SUPER, -1))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """4-bit values of ``qs`` [..., chunks, 32]: each chunk of 32 bytes holds 64 values,
    the first 32 in the low nibbles -> [..., chunks * 64]."""
    pair = torch.stack([qs & 15, qs >> 4], dim=-2)
    return pair.flatten(-3)


def _file_values(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """The values [out, in] (int16, as stored: Q6_K's stand for q - 32) of the file's
    super-blocks ``blocks`` [out, super-blocks, bytes]."""
    out = blocks.shape[0]
    if fmt == "Q6_K":
        # Each half of 128 values: ql's 64 bytes hold values 0-63 (low nibbles) and 64-127
        # (high), qh's 32 bytes hold the top 2 bits of values l, 32 + l, 64 + l, 96 + l.
        ql = blocks[..., :128].reshape(out, -1, 2, 64).to(torch.int16)
        qh = blocks[..., 128:192].reshape(out, -1, 2, 32).to(torch.int16)
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)
        return _nibbles(ql).reshape(out, -1) | (high.reshape(out, -1) << 4)
    qs = blocks[..., -128:].reshape(out, -1, 4, 32).to(torch.int16)
    q = _nibbles(qs).reshape(out, -1, 8, 32)
    if fmt == "Q5_K":
        qh = blocks[..., 16:48].to(torch.int16)  # bit i of byte l: sub-block i, value l
        high = torch.stack([(qh >> i) & 1 for i in range(8)], dim=-2)
        q = q | (high << 4)
    return q.reshape(out, -1)


def _high_of(fmt: str, high: str) -> str:
    """The layout of a ``fmt`` weight's high bits asked for as ``high``: Q5_K's and Q6_K's
    as asked, Q4_K's planes (it has no high bits, so one layout)."""
    if high not in HIGH_LAYOUTS:
        raise ValueError(f"{high!r} is not a layout of high bits: {', '.join(HIGH_LAYOUTS)}")
    return PLANES if fmt == "Q4_K" else high


def from_gguf(
    data: torch.Tensor, fmt: str, shape: tuple[int, int], high: str = PLANES
) -> KQuantWeight:
    """Unpack GGUF's raw K-quant super-blocks ``data`` [out, bytes per row], Q5_K's and
    Q6_K's high bits in the layout ``high`` (Q4_K has one)."""
    if fmt not in _BYTES:
        raise ValueError(f"GGUF K-quant format {fmt!r} is not one of {', '.join(FORMATS)}")
    high = _high_of(fmt, high)
    out, k = shape
    if k % SUPER:
        raise ValueError(f"a {fmt} weight needs a multiple of {SUPER} inputs, not {k}")
    blocks = data.reshape(out, k // SUPER, _BYTES[fmt])
    at, size = _SCALES_AT[fmt]
    scales = blocks[..., at : at + size].reshape(out, -1).contiguous()
    q = _file_values(blocks, fmt)
    if fmt == "Q4_K":
        nibbles = q.reshape(out, k // BLOCK, 2, BLOCK // 2).to(torch.uint8)
        qs = (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).contiguous()
    else:
        qs = _packed(q, 6 if fmt == "Q6_K" else 5, high)
    return KQuantWeight(fmt, qs, scales, shape, high)


def empty_weight(
    fmt: str, shape: tuple[int, int], device: str = "cpu", high: str = PLANES
) -> KQuantWeight:
    """An uninitialized :class:`KQuantWeight` of ``fmt`` and ``shape`` (Q5_K's and Q6_K's
    high bits in the layout ``high``), to be filled (on the ``meta`` device: its layout only)."""
    high = _high_of(fmt, high)
    out, k = shape
    size = _SCALES_AT[fmt][1]
    scales = torch.empty(out, k // SUPER * size, dtype=torch.uint8, device=device)
    if fmt == "Q4_K":
        qs = torch.empty(out, k // BLOCK, BLOCK // 2, dtype=torch.uint8, device=device)
    else:
        record = 2 * HALF + 8 * (int(fmt[1]) - 4)
        qs = torch.empty(out, k // (2 * BLOCK) * record, dtype=torch.uint8, device=device)
    return KQuantWeight(fmt, qs, scales, shape, high)


def _packed(q: torch.Tensor, bits: int, high: str = PLANES) -> torch.Tensor:
    """Values ``q`` [out, in] in 0..2^bits - 1 as :class:`KQuantWeight`'s 5- or 6-bit
    ``qs`` (the high bits in the layout ``high``)."""
    out, k = q.shape
    pairs = q.reshape(out, k // (2 * BLOCK), 2, BLOCK).to(torch.int32)
    low = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).to(torch.uint8)
    if high == PACKED and bits == 5:
        fifth = ((pairs >> 4) & 1).reshape(out, k // (2 * BLOCK), 2, 4, 8)  # value 8q + b
        shifts = torch.arange(4, dtype=torch.int32)[:, None]  # q
        first = (fifth[..., 0, :, :] << (shifts + 4)).sum(-2)
        second = (fifth[..., 1, :, :] << shifts).sum(-2)
        packed = (first | second).to(torch.uint8)  # [out, pairs, 8]
        return torch.cat([low, packed], dim=-1).reshape(out, -1).contiguous()
    if high == PACKED:
        two = (pairs >> 4) & 3  # [out, pairs, 2 blocks, 32]
        first, second = two[..., 0, :], two[..., 1, :]
        packed = (
            second[..., :HALF]
            | (second[..., HALF:] << 2)
            | (first[..., :HALF] << 4)
            | (first[..., HALF:] << 6)
        ).to(torch.uint8)
        return torch.cat([low, packed], dim=-1).reshape(out, -1).contiguous()
    # a plane's word as its four little-endian bytes: byte t holds values 8t..8t+7
    weights = torch.ones(8, dtype=torch.int32) << torch.arange(8, dtype=torch.int32)
    planes = [
        (((pairs >> bit) & 1).reshape(*pairs.shape[:-1], 4, 8) * weights).sum(-1)
        for bit in range(4, bits)
    ]
    words = torch.stack(planes, dim=-2)  # [out, pairs, 2 blocks, planes, 4 bytes]
    plane_bytes = words.to(torch.uint8).reshape(out, k // (2 * BLOCK), -1)
    return torch.cat([low, plane_bytes], dim=-1).reshape(out, -1).contiguous()


def values(weight: KQuantWeight) -> torch.Tensor:
    """The file's values [out, in] (int16) of ``weight``, Q6_K's centred (q - 32)."""
    out, k = weight.shape
    if weight.bits == 4:
        return torch.cat([weight.qs & 15, weight.qs >> 4], dim=-1).reshape(out, k).to(torch.int16)
    planes = weight.bits - 4
    records = weight.qs.reshape(out, k // (2 * BLOCK), 2 * HALF + 8 * planes)
    low = records[..., : 2 * HALF].to(torch.int16)
    q = torch.stack([low & 15, low >> 4], dim=-2)  # [out, pairs, 2 blocks, 32]
    if weight.high == PACKED and weight.bits == 5:
        packed = records[..., 2 * HALF :].to(torch.int16)[..., None, :]  # [out, pairs, 1, 8]
        shifts = torch.arange(4, dtype=torch.int16)[:, None]  # value 8q + b: shift q
        first = ((packed >> (shifts + 4)) & 1).flatten(-2)
        second = ((packed >> shifts) & 1).flatten(-2)
        return (q | (torch.stack([first, second], dim=-2) << 4)).reshape(out, k)
    if weight.high == PACKED:
        packed = records[..., 2 * HALF :].to(torch.int16)  # [out, pairs, 16]
        first = torch.cat([(packed >> 4) & 3, (packed >> 6) & 3], dim=-1)
        second = torch.cat([packed & 3, (packed >> 2) & 3], dim=-1)
        q = q | (torch.stack([first, second], dim=-2) << 4)
        return q.reshape(out, k) - 32
    words = records[..., 2 * HALF :].contiguous().view(torch.int32).reshape(out, -1, 2, planes)
    shifts = torch.arange(BLOCK, dtype=torch.int32)
    for plane in range(planes):
        q = q | ((((words[..., plane, None] >> shifts) & 1) << (4 + plane)).to(torch.int16))
    q = q.reshape(out, k)
    return q - 32 if weight.bits == 6 else q


def four_bit_blocks(weight: KQuantWeight) -> BlockWeight:
    """A Q4_K ``weight`` as 4-bit :class:`BlockWeight` blocks of 32 with float32 scales and
    offsets (d sc, -(dmin mn)): the layout of methods without a Q4_K kernel."""
    if weight.fmt != "Q4_K":
        raise ValueError(f"only Q4_K has 4-bit blocks of 32, not {weight.fmt}")
    d, m = float_scales(weight)
    return BlockWeight(4, weight.qs, d.contiguous(), m.contiguous(), weight.shape)


def dequantize(weight: KQuantWeight) -> torch.Tensor:
    """The float32 weight [out, in] of ``weight``."""
    out, k = weight.shape
    d, m = float_scales(weight)
    per_scale = HALF if weight.fmt == "Q6_K" else BLOCK
    values_ = values(weight).float().reshape(out, k // per_scale, per_scale)
    scaled = (values_ * d.unsqueeze(-1)).reshape(out, k)
    if weight.fmt == "Q6_K":
        return scaled
    return (scaled.reshape(out, k // BLOCK, BLOCK) + m.unsqueeze(-1)).reshape(out, k)
