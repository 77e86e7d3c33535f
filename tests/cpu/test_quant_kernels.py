"""``quant_kernels``: the block products against a float64 sum over the same integers.

Every block count's tail (groups of 4, 2 and 1 blocks in the AVX-512 loop) and several
row counts; the activations' 8-bit rounding against torch's rounding of the same values.
"""

from __future__ import annotations

import pytest
import torch

from enginecore.block_formats import gguf_blocks
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore_cpu import quant_kernels

pytestmark = pytest.mark.skipif(quant_kernels.load() is None, reason="no C compiler")

BLOCK = gguf_blocks.BLOCK


def random_q4(n: int, k: int, symmetric: bool) -> BlockWeight:
    nb = k // BLOCK
    qs = torch.randint(0, 256, (n, nb, 16), dtype=torch.uint8)
    d = torch.rand(n, nb) * 0.1 + 0.01
    m = -8.0 * d if symmetric else torch.randn(n, nb) * 0.1
    return BlockWeight(4, qs, d, m.contiguous(), (n, k))


def random_q8(n: int, k: int) -> BlockWeight:
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = torch.rand(n, k // BLOCK) * 0.01 + 0.001
    return BlockWeight(8, qs, d, torch.zeros_like(d), (n, k))


def values_of(weight: BlockWeight) -> torch.Tensor:
    """[n, nb, 32] float64 integers of the weight, in element order."""
    n, k = weight.shape
    if weight.bits == 8:
        return weight.qs.reshape(n, k // BLOCK, BLOCK).double()
    return torch.cat([weight.qs & 0x0F, weight.qs >> 4], dim=-1).double()


def reference(acts: quant_kernels.QuantizedActivations, weight: BlockWeight) -> torch.Tensor:
    """sum_b d_w d_x <q_w, q_x> + m_w d_x sum(q_x), in float64."""
    rows, k = acts.q.shape
    qx = acts.q.reshape(rows, k // BLOCK, BLOCK).double()
    dots = torch.einsum("rbi,nbi->rnb", qx, values_of(weight))
    scaled = dots * weight.d.double()[None] * acts.scale.double()[:, None]
    offsets = weight.m.double()[None] * acts.scaled_sum.double()[:, None]
    return (scaled + offsets).sum(-1)


@pytest.mark.parametrize("k", [32, 64, 96, 128, 160, 224, 576])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_linear_matches_float64(kind: str, rows: int, k: int):
    torch.manual_seed(k * 100 + rows)
    n = 37  # not a multiple of any vector width or thread split
    weight = random_q8(n, k) if kind == "q8_0" else random_q4(n, k, symmetric=kind == "q4_0")
    kernels = quant_kernels.load()
    x = torch.randn(rows, k) * 3
    out = torch.full((rows, n), float("nan"))
    kernels.linear(x, weight, out)
    want = reference(kernels.quantize_rows(x), weight)
    scale = want.abs().max().item()
    assert (out.double() - want).abs().max().item() <= 1e-5 * scale


def test_linear_writes_into_a_strided_output():
    """A fused projection's part writes its columns of a wider output, nothing else."""
    torch.manual_seed(0)
    weight = random_q4(24, 96, symmetric=False)
    kernels = quant_kernels.load()
    x = torch.randn(3, 96)
    out = torch.zeros(3, 40)
    kernels.linear(x, weight, out[:, 8:])
    want = reference(kernels.quantize_rows(x), weight)
    assert torch.allclose(out[:, 8:32].double(), want, rtol=1e-5, atol=1e-5)
    assert not out[:, :8].any() and not out[:, 32:].any()


def test_activations_round_as_torch_does():
    torch.manual_seed(1)
    x = torch.randn(7, 576) * torch.rand(7, 1) * 10
    x[0, :BLOCK] = 0  # an all-zero block: scale 0, bytes 0
    acts = quant_kernels.load().quantize_rows(x)
    blocks = x.reshape(7, -1, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8)
    assert torch.equal(acts.q.reshape(7, -1, BLOCK), q)
    assert torch.equal(acts.scale, scale)
    assert torch.equal(acts.scaled_sum, scale * q.sum(-1).float())


@pytest.mark.parametrize("k", [32, 96, 224, 576, 1184])
@pytest.mark.parametrize("rows", [1, 5])
def test_float16_scales_give_the_float32_scales_bits(rows: int, k: int):
    """Q4_0 / Q4_1 blocks keep the file's float16 scales: the product is the one with the
    same scales widened to float32, bit for bit, at every tail of the block loop."""
    torch.manual_seed(k + rows)
    wide = random_q4(41, k, symmetric=False)
    wide.d, wide.m = wide.d.half().float(), wide.m.half().float()
    half = BlockWeight(4, wide.qs, wide.d.half(), wide.m.half(), wide.shape)
    assert (half.kind, wide.kind) == (gguf_blocks.Q4_HALF_SCALES, 4)
    kernels = quant_kernels.load()
    x = torch.randn(rows, k)
    got, want = torch.empty(rows, 41), torch.empty(rows, 41)
    kernels.linear(x, half, got)
    kernels.linear(x, wide, want)
    assert torch.equal(got, want)
    assert torch.equal(gguf_blocks.dequantize(half), gguf_blocks.dequantize(wide))


@pytest.mark.parametrize("k", [32, 96, 224, 576, 1184])
@pytest.mark.parametrize("rows", [1, 5])
def test_q4_0_forms_its_offsets_from_its_scales(rows: int, k: int):
    """A Q4_0 weight's offsets are -8 d: the kernel forms them from ``d`` and never reads
    ``m`` (NaN here), with the bits of the product that reads them."""
    torch.manual_seed(k * 3 + rows)
    wide = random_q4(41, k, symmetric=True)
    d = wide.d.half()
    read = BlockWeight(4, wide.qs, d, (-8.0 * d.float()).half(), wide.shape)
    formed = BlockWeight(4, wide.qs, d, torch.full_like(d, float("nan")), wide.shape, True)
    assert (formed.kind, read.kind) == (gguf_blocks.Q4_0_HALF_SCALES, gguf_blocks.Q4_HALF_SCALES)
    kernels = quant_kernels.load()
    x = torch.randn(rows, k)
    got, want = torch.empty(rows, 41), torch.empty(rows, 41)
    kernels.linear(x, formed, got)
    kernels.linear(x, read, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("rows", [1, 5])
def test_q8_0_float16_scales_give_the_float32_scales_bits(rows: int, k: int):
    """Q8_0 keeps the file's float16 scales: the product is the one with the same scales
    widened to float32, bit for bit."""
    torch.manual_seed(k * 7 + rows)
    wide = random_q8(23, k)
    wide.d = wide.d.half().float()
    half = BlockWeight(8, wide.qs, wide.d.half(), wide.m.half(), wide.shape)
    assert (half.kind, wide.kind) == (gguf_blocks.Q8_HALF_SCALES, 8)
    kernels = quant_kernels.load()
    x = torch.randn(rows, k)
    got, want = torch.empty(rows, 23), torch.empty(rows, 23)
    kernels.linear(x, half, got)
    kernels.linear(x, wide, want)
    assert torch.equal(got, want)
    assert torch.equal(gguf_blocks.dequantize(half), gguf_blocks.dequantize(wide))


def test_q4_0_scales_beyond_float16_after_the_offset_stay_float32():
    """Q4_0's offset is -8 d: where that overflows float16, both stay float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    for scale, dtype in ((1.0, torch.float16), (60000.0, torch.float32)):
        weight = (torch.randn(4, 64) * scale).numpy()
        raw = torch.from_numpy(quantize(weight, GGMLQuantizationType.Q4_0))
        blocks = gguf_blocks.from_gguf(raw, "Q4_0", (4, 64))
        assert blocks.d.dtype == blocks.m.dtype == dtype
        assert torch.isfinite(blocks.m).all()
        assert torch.equal(blocks.m, -8.0 * blocks.d)
        assert blocks.symmetric == (dtype == torch.float16)
