"""GGUF's blocks unpacked in C (the first load's preparation pass: ``eck_repack_k`` for
Q4_K / Q5_K / Q6_K super-blocks, ``eck_repack_blocks`` for Q8_0 / Q4_0 / Q4_1) give the
bytes of ``kquant_blocks.from_gguf`` / ``gguf_blocks.from_gguf`` (the layouts the kernels
multiply), in every build this CPU runs, for row ranges read straight from a file's rows
and joined into one weight; and the values they stand for are gguf's."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.layers.quantized import QuantizedTensor
from enginecore_cpu import cpu_kernels, gguf_linear_method, kquant_kernels
from enginecore_cpu.gguf_linear_method import _merged, _unpacked_runs
from tests.helpers.kernel_builds import build_for

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(kquant_kernels.load() is None, reason="no C compiler")

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX512 = _X86 and cpu_kernels.instruction_set() == "x86-64-v4"
_LEVELS = ["host", *(["x86-64-v3", "x86-64"] if _X86 else [])]
_LEVELS[1:1] = ["x86-64-v4"] if _AVX512 else []
FORMATS = ["Q4_K", "Q5_K", "Q6_K"]


def random_rows(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random super-blocks [rows, bytes per row], their float16 fields finite."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    count = rows * cols // block
    data = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for offset in {"Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,)}.get(fmt, (0, 2)):
        halves = rng.uniform(1e-3, 2e-2, size=count).astype(np.float16)
        data[:, offset : offset + 2] = halves.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(data.reshape(rows, -1))


def same_weight(got: kquant_blocks.KQuantWeight, want: kquant_blocks.KQuantWeight) -> None:
    assert got.fmt == want.fmt and got.shape == want.shape and got.high == want.high
    for name in ("qs", "scales"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and torch.equal(a, b), name


@pytest.fixture(scope="module")
def builds() -> dict[str, ctypes.CDLL]:
    return {level: build_for(level, kquant_kernels.SOURCE) for level in _LEVELS}


@pytest.mark.parametrize("shape", [(1, 256), (9, 2048)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("level", _LEVELS)
def test_repack_gives_from_ggufs_bytes_in_every_build(builds, level, fmt, shape):
    rows, cols = shape
    wide = random_rows(fmt, 2 * rows, cols, seed=rows * cols)
    data = wide[::2]  # rows further apart than their bytes, as a view of a file can be
    # Q5_K's and Q6_K's high bits as the build keeps them: packed on AVX2, else bit planes
    high = kquant_blocks.PLANES
    if fmt != "Q4_K":
        packed = getattr(builds[level], f"eck_q{fmt[1]}_packed")
        packed.restype = ctypes.c_int64
        high = kquant_blocks.PACKED if packed() else kquant_blocks.PLANES
    if level != "host" and fmt != "Q4_K":
        assert (high == kquant_blocks.PACKED) == (level == "x86-64-v3")
    want = kquant_blocks.from_gguf(data.contiguous(), fmt, shape, high)
    got = kquant_blocks.empty_weight(fmt, shape, high=high)
    fn = builds[level].eck_repack_k
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
    fn(got.bits, rows, cols, data.data_ptr(), data.stride(0), None, got.qs.data_ptr(),
       got.scales.data_ptr())  # fmt: skip
    same_weight(got, want)
    reference = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[fmt])
    values = kquant_blocks.dequantize(got).numpy()
    assert np.array_equal(reference.reshape(values.shape).view(np.uint32), values.view(np.uint32))
    if fmt != "Q4_K":  # the build's own de-quantization reads its layout
        out = torch.empty(shape)
        fn = builds[level].eck_dequantize_k
        fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
        fn(rows, cols, got.bits, got.qs.data_ptr(), got.scales.data_ptr(), out.data_ptr())
        assert np.array_equal(values.view(np.uint32), out.numpy().view(np.uint32))


def test_q5_k_packed_keeps_the_fifth_bits_eight_values_a_byte():
    """Q5_K's packed layout: a pair record's last 8 bytes, byte b holding the 5th bits of
    the first block's values b, 8 + b, 16 + b, 24 + b in bits 4-7 and of the second
    block's in bits 0-3; the values, and so gguf's floats, are the file's."""
    rows, cols = 3, 512
    data = random_rows("Q5_K", rows, cols, seed=5)
    weight = kquant_blocks.from_gguf(data, "Q5_K", (rows, cols), kquant_blocks.PACKED)
    assert weight.high == kquant_blocks.PACKED
    planes = kquant_blocks.from_gguf(data, "Q5_K", (rows, cols))
    assert torch.equal(kquant_blocks.values(weight), kquant_blocks.values(planes))
    fifth = (kquant_blocks.values(planes).reshape(rows, -1, 2, 4, 8) >> 4) & 1
    records = weight.qs.reshape(rows, -1, 40).to(torch.int64)
    for b in range(8):
        for q in range(4):
            byte = records[..., 32 + b]
            assert torch.equal((byte >> (4 + q)) & 1, fifth[..., 0, q, b])
            assert torch.equal((byte >> q) & 1, fifth[..., 1, q, b])
    assert torch.equal(records[..., :32], planes.qs.reshape(rows, -1, 40)[..., :32].long())
    reference = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType.Q5_K)
    values = kquant_blocks.dequantize(weight).numpy()
    assert np.array_equal(reference.reshape(values.shape).view(np.uint32), values.view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_pieces_join_into_one_weight_with_ggufs_values(fmt):
    """Row ranges (a QKV's or a gate/up's) unpacked into one weight: the bytes of their
    joined reference, and gguf's numpy values bit for bit."""
    cols = 512
    pieces = [random_rows(fmt, rows, cols, seed=rows) for rows in (8, 4, 2)]
    tensors = [QuantizedTensor(p, fmt, (p.shape[0], cols)) for p in pieces]
    got = kquant_kernels.load().unpacked(tensors)
    joined = torch.cat(pieces)
    same_weight(got, kquant_kernels.load().from_gguf(joined, fmt, (14, cols)))
    want = gguf.quants.dequantize(joined.numpy(), gguf.GGMLQuantizationType[fmt])
    values = kquant_blocks.dequantize(got).numpy()
    assert np.array_equal(want.reshape(values.shape).view(np.uint32), values.view(np.uint32))


def test_a_q4_k_m_layer_unpacks_as_before(monkeypatch):
    """Q4_K_M's QKV (Q, K in Q4_K, V in Q6_K): the Q4_K run becomes one weight, the Q6_K
    range another, byte for byte what the torch pass and ``_merged`` made; no piece goes
    through the torch pass."""
    cols = 512
    pieces = {
        0: QuantizedTensor(random_rows("Q4_K", 32, cols, 1), "Q4_K", (32, cols)),
        32: QuantizedTensor(random_rows("Q4_K", 16, cols, 2), "Q4_K", (16, cols)),
        48: QuantizedTensor(random_rows("Q6_K", 16, cols, 3), "Q6_K", (16, cols)),
    }
    # the torch pass, Q6_K's high bits in the layout of the engine's build
    kquant = kquant_kernels.load()
    want = _merged(
        {first: kquant.from_gguf(p.data, p.format, p.shape) for first, p in pieces.items()}
    )
    torch_pass = []
    monkeypatch.setattr(gguf_linear_method, "unpacked", lambda t: torch_pass.append(t))
    got = _unpacked_runs(pieces)
    assert torch_pass == []
    assert [first for first, _ in got] == [first for first, _ in want] == [0, 48]
    for (_, mine), (_, theirs) in zip(got, want, strict=True):
        same_weight(mine, theirs)


@pytest.mark.parametrize("shape", [(1, 32), (9, 2048)])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("level", _LEVELS)
def test_block_repack_gives_from_ggufs_bytes_in_every_build(builds, level, fmt, shape):
    rows, cols = shape
    data = random_rows(fmt, 2 * rows, cols, seed=rows * cols)[::2]
    want = gguf_blocks.from_gguf(data.contiguous(), fmt, shape)
    got = gguf_blocks.empty_blocks(fmt, shape)
    fn = builds[level].eck_repack_blocks
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int64
    kind = {"Q8_0": 8, "Q4_0": 40, "Q4_1": 41}[fmt]
    bad = fn(kind, rows, cols, data.data_ptr(), data.stride(0), None, got.qs.data_ptr(),
             got.d.data_ptr(), got.m.data_ptr())  # fmt: skip
    assert bad == 0
    assert (got.kind, got.symmetric) == (want.kind, want.symmetric)
    for name in ("qs", "d", "m"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        as_bits = torch.int16 if a.dtype == torch.float16 else torch.uint8
        assert torch.equal(a.view(as_bits), b.view(as_bits)), name


def test_a_q4_0_offset_float16_cannot_hold_is_refused():
    """-8 d past float16's range (``from_gguf`` keeps float32 scales then): the C pass
    says so rather than write a wrong offset."""
    data = random_rows("Q4_0", 4, 64)
    data[2, 18:20] = torch.tensor([20000.0], dtype=torch.float16).view(torch.uint8)
    assert gguf_blocks.from_gguf(data, "Q4_0", (4, 64)).d.dtype == torch.float32
    target = gguf_blocks.empty_blocks("Q4_0", (4, 64))
    tensor = QuantizedTensor(data, "Q4_0", (4, 64))
    assert not kquant_kernels.load().blocks_into([tensor], target)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
def test_q_k_rows_are_read_in_rotary_order_without_a_copy(fmt):
    """A Llama q/k weight's rows, stored in llama.cpp's rotary order, are read in HF's
    order by the C pass itself (``stored_rows``): the bytes of the pass over the rows
    reordered by ``unpermute_rope``, for a shard of them too, and ``data`` never made."""
    from enginecore_models import weight_loader

    heads, rows, cols = 4, 32, 512
    raw = random_rows(fmt, rows, cols, seed=11)
    tensor = weight_loader._RopeOrderedTensor(
        weight_loader._RopeRows(raw, heads), fmt, (rows, cols), "q"
    )
    ordered = weight_loader.unpermute_rope(raw, heads).contiguous()
    kernels = kquant_kernels.load()
    for piece, want_rows in [(tensor, ordered), (tensor.rows(8, 16), ordered[8:24])]:
        shape = (want_rows.shape[0], cols)
        if fmt in kquant_blocks.FORMATS:
            same_weight(kernels.unpacked([piece]), kquant_blocks.from_gguf(want_rows, fmt, shape))
        else:
            got = gguf_blocks.empty_blocks(fmt, shape)
            assert kernels.blocks_into([piece], got)
            want = gguf_blocks.from_gguf(want_rows, fmt, shape)
            assert torch.equal(got.qs.view(torch.uint8), want.qs.view(torch.uint8))
            assert torch.equal(got.d.view(torch.int16), want.d.view(torch.int16))
        assert "data" not in vars(piece)
