"""Decode attention (``ec_decode_attention``) in every build this CPU can run: the
AVX-512 and AVX2 versions specialized per query heads per KV head and head dim, and the
portable one, against torch's SDPA on the same decode-mirror layer; its positions cut
into spans (``ec_attention_spans``) whose partial softmax sums are merged.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from enginecore_cpu import cpu_kernels
from tests.helpers.kernel_builds import LEVELS, cpu_kernel_builds

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def builds() -> dict[str, cpu_kernels.CpuKernels]:
    return cpu_kernel_builds()


def _sdpa(query, layer, lens, scale, window=0):
    n, hq, _ = query.shape
    hkv = layer.shape[2]
    out = torch.empty_like(query)
    for r in range(n):
        start = max(0, int(lens[r]) - window) if window else 0
        k = layer[0, r, :, start : lens[r]].repeat_interleave(hq // hkv, dim=0)
        v = layer[1, r, :, start : lens[r]].repeat_interleave(hq // hkv, dim=0)
        out[r] = F.scaled_dot_product_attention(query[r][:, None], k, v, scale=scale)[:, 0]
    return out


# (query heads, KV heads, head dim): groups of 3 (SmolLM2-135M, 9 / 3), 6 and 7 (Qwen2.5)
# beside the powers of two, at dims 64 and 128
@pytest.mark.parametrize(
    "hq,hkv,d", [(9, 3, 64), (6, 1, 64), (14, 2, 128), (3, 1, 128), (8, 2, 64), (4, 4, 128)]
)
@pytest.mark.parametrize("level", LEVELS)
def test_decode_attention_matches_sdpa_in_every_build(builds, level, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * 1000 + d)
    n, cap = 3, 140  # lengths cross the kernel's 64-position blocks
    layer = torch.randn(2, n, hkv, cap, d, generator=gen)
    query = torch.randn(n, hq, d, generator=gen)
    lens = torch.tensor([1, 65, 140])
    got = builds[level].decode_attention(query, layer, lens, d**-0.5, None)
    torch.testing.assert_close(got, _sdpa(query, layer, lens, d**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (24, 8, 128), (7, 1, 128)])
@pytest.mark.parametrize("level", LEVELS)
def test_decode_attention_merges_its_spans_as_sdpa_in_every_build(builds, level, hq, hkv, d):
    """Lengths of one span to the most (EC_MAX_SPANS), with and without a window."""
    gen = torch.Generator().manual_seed(hq * 7 + d)
    lens = torch.tensor([64, 65, 129, 300, 513, 1500])
    layer = torch.randn(2, len(lens), hkv, 1500, d, generator=gen)
    query = torch.randn(len(lens), hq, d, generator=gen)
    for window in (0, 200):
        got = builds[level].decode_attention(query, layer, lens, d**-0.5, window)
        want = _sdpa(query, layer, lens, d**-0.5, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("level", LEVELS)
def test_attention_spans_split_any_kv_heads_evenly_over_two_threads(builds, level):
    """The fused step's attention units are a row's KV heads' spans: past one span's
    positions a head is cut into an even number of spans, so 1, 3, 5 or 7 KV heads (the
    demo model has 3) still split evenly over two threads."""
    spans_of = builds[level].lib.ec_attention_spans
    spans_of.argtypes, spans_of.restype = [ctypes.c_int64], ctypes.c_int64
    spans = [spans_of(positions) for positions in range(1, 5000)]
    assert spans[:64] == [1] * 64
    assert all(s in (2, 4, 8) for s in spans[64:]), set(spans[64:])
    assert spans == sorted(spans) and spans[-1] == 8
    assert spans_of(129) == 4  # 3 KV heads at 129 positions: 12 units
