"""The K/V kernels over a float16 or bfloat16 KV cache (``cache.kv_cache_dtype``), in every
build this CPU can run: writes into the paged cache and the decode mirror round as torch's
``.to()`` does, bit for bit; the mirror's fill copies half elements; decode attention (the
layers' kernel, and the fused step's spans and merge) equals SDPA over the same rounded
K/V widened to float32, one row and many, with GQA, MHA and a sliding window."""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

import pytest
import torch
import torch.nn.functional as F

from enginecore_cpu import cpu_kernels, decode_step
from tests.helpers.kernel_builds import LEVELS, cpu_kernel_builds

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")

HALVES = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def builds() -> dict[str, cpu_kernels.CpuKernels]:
    return cpu_kernel_builds()


def _sdpa(query, layer, lens, scale, window=0):
    """Row r's query heads over its first lens[r] positions (the last ``window``) of a
    mirror layer [2, rows, H_kv, cap, D], widened to float32 as the kernels read it."""
    n, hq, _ = query.shape
    hkv = layer.shape[2]
    out = torch.empty_like(query)
    for r in range(n):
        start = max(0, int(lens[r]) - window) if window else 0
        k = layer[0, r, :, start : lens[r]].float().repeat_interleave(hq // hkv, dim=0)
        v = layer[1, r, :, start : lens[r]].float().repeat_interleave(hq // hkv, dim=0)
        out[r] = F.scaled_dot_product_attention(query[r][:, None], k, v, scale=scale)[:, 0]
    return out


def _awkward_values(count: int, gen: torch.Generator) -> torch.Tensor:
    """Normal values and the ones rounding gets wrong: ties, subnormals, overflow, signed
    zero, infinities."""
    special = torch.tensor(
        [0.0, -0.0, 1e-8, -3e-8, 6e-8, 1e-5, 6.1e-5, 65504.0, 65519.0, 65520.0, 1e6,
         float("inf"), float("-inf"), 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 3e38]
    )  # fmt: skip
    values = torch.randn(count, generator=gen) * 10.0 ** torch.randint(
        -6, 6, (count,), generator=gen
    )
    values[: len(special)] = special
    return values


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_cache_and_mirror_writes_round_as_torch_in_every_build(builds, level, dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, h, d = 24, 2, 40  # a head dim that is no multiple of the vector widths
    key = _awkward_values(tokens * h * d, gen).view(tokens, h, d)
    value = -key.flip(0)
    kernels = builds[level]

    cache = torch.full((2, 4, 8, h, d), 7.0).to(dtype)  # 32 slots
    slots = torch.randperm(32, generator=gen)[:tokens]
    kernels.write_kv(cache, key, value, slots)
    want = cache.clone()
    flat = want.view(2, 32, h, d)
    flat[0, slots], flat[1, slots] = key.to(dtype), value.to(dtype)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))

    layer = torch.zeros((2, tokens, h, 16, d), dtype=dtype)
    lens = torch.randint(1, 17, (tokens,), generator=gen)
    kernels.mirror_append(layer, key, value, lens)
    rows = torch.arange(tokens)
    assert torch.equal(
        layer[0, rows, :, lens - 1].view(torch.int16), key.to(dtype).view(torch.int16)
    )
    assert torch.equal(
        layer[1, rows, :, lens - 1].view(torch.int16), value.to(dtype).view(torch.int16)
    )


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_the_mirror_fills_from_a_half_cache(builds, dtype):
    gen = torch.Generator().manual_seed(5)
    block_size, h, d = 4, 2, 64
    cache = torch.randn((2, 10, block_size, h, d), generator=gen).to(dtype)
    table = torch.tensor([[7, 2, 9], [0, 5, 1]])
    lens = torch.tensor([11, 6])
    layer = torch.zeros((2, 4, h, 16, d), dtype=dtype)
    builds["host"].mirror_fill(layer, cache, table, lens, row0=1)
    for i in range(2):
        positions = cache[:, table[i]].reshape(2, -1, h, d)[:, : lens[i]].transpose(1, 2)
        assert torch.equal(layer[:, 1 + i, :, : lens[i]], positions)
    with pytest.raises(TypeError):  # a mirror of another dtype than its cache
        builds["host"].mirror_fill(layer.float(), cache, table, lens, row0=1)


# (query heads, KV heads, head dim): GQA groups of 3, 4, 7 and 2, MHA, and a head dim no
# specialized kernel takes (the portable loop)
SHAPES = [(9, 3, 64), (32, 8, 128), (7, 1, 128), (4, 2, 64), (4, 4, 128), (6, 2, 40)]


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("level", LEVELS)
def test_decode_attention_over_half_kv_is_sdpa_over_it_in_every_build(
    builds, level, hq, hkv, d, dtype
):
    """One row, then many rows of lengths from one position to several spans, with and
    without a window."""
    gen = torch.Generator().manual_seed(hq * 100 + d)
    lens = torch.tensor([300, 1, 64, 65, 129, 513, 1100])
    layer = torch.randn(2, len(lens), hkv, 1100, d, generator=gen).to(dtype)
    query = torch.randn(len(lens), hq, d, generator=gen)
    for rows in (1, len(lens)):
        for window in (0, 200):
            got = builds[level].decode_attention(
                query[:rows], layer, lens[:rows], d**-0.5, window or None
            )
            want = _sdpa(query[:rows], layer, lens[:rows], d**-0.5, window)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def _step_library() -> ctypes.CDLL:
    """The fused decode step's library, with its own (serial) build of the attention."""
    lib = ctypes.CDLL(str(decode_step.build()))
    lib.ec_attention_spans.argtypes = [c_int64]
    lib.ec_attention_spans.restype = c_int64
    lib.ec_attend_span.argtypes = [
        c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_float, c_int64,
        c_int64, c_void_p, c_int,
    ]  # fmt: skip
    lib.ec_merge_spans.argtypes = [c_void_p, c_int64, c_int64, c_int64, c_void_p]
    return lib


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 4, 128)])
def test_the_fused_steps_attention_over_half_kv_is_sdpa_over_it(hq, hkv, d, dtype):
    """The step attends a (row, KV head) span by span (ec_attend_span, its units) and
    merges the spans (ec_merge_spans): over the half mirror, as SDPA over it."""
    lib = _step_library()
    gen = torch.Generator().manual_seed(hq + d)
    lens = torch.tensor([1, 64, 200, 700])
    layer = torch.randn(2, len(lens), hkv, 700, d, generator=gen).to(dtype)
    query = torch.randn(len(lens), hq, d, generator=gen)
    group, kv_type = hq // hkv, cpu_kernels.KV_TYPES[dtype]
    for window in (0, 100):
        got = torch.empty_like(query)
        for r, length in enumerate(lens.tolist()):
            start = max(0, length - window) if window else 0
            spans = lib.ec_attention_spans(length - start)
            parts = torch.empty(spans, group * d + 2 * group)
            for kh in range(hkv):
                k, v = layer[0, r, kh], layer[1, r, kh]
                q = query[r, kh * group : (kh + 1) * group].contiguous()
                for j in range(spans):
                    lo = start + (length - start) * j // spans
                    hi = start + (length - start) * (j + 1) // spans
                    lib.ec_attend_span(
                        q.data_ptr(), k.data_ptr(), v.data_ptr(), lo, hi, 700, 0, d**-0.5,
                        group, d, parts[j].data_ptr(), kv_type,
                    )  # fmt: skip
                out = torch.empty(group, d)
                lib.ec_merge_spans(parts.data_ptr(), spans, group, d, out.data_ptr())
                got[r, kh * group : (kh + 1) * group] = out
        want = _sdpa(query, layer, lens, d**-0.5, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
