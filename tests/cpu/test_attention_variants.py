"""Decode attention (``ec_decode_attention``) in every build this CPU can run: the
AVX-512 and AVX2 versions specialized per query heads per KV head and head dim, and the
portable one, against torch's SDPA on the same decode-mirror layer.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from enginecore_cpu import cpu_kernels
from tests.helpers.kernel_builds import extra_isa_for

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_LEVELS = ["host", *(["x86-64-v3", "x86-64"] if _X86 else [])]


@pytest.fixture(scope="module")
def builds() -> dict[str, cpu_kernels.CpuKernels]:
    return {
        level: cpu_kernels.CpuKernels(
            cpu_kernels.build(
                source=cpu_kernels.SOURCE,
                stem=f"enginecore_{cpu_kernels.SOURCE.stem}",
                extra_isa=extra_isa_for(level),
            )
        )
        for level in _LEVELS
    }


def _sdpa(query, layer, lens, scale):
    n, hq, _ = query.shape
    hkv = layer.shape[2]
    out = torch.empty_like(query)
    for r in range(n):
        k = layer[0, r, :, : lens[r]].repeat_interleave(hq // hkv, dim=0)
        v = layer[1, r, :, : lens[r]].repeat_interleave(hq // hkv, dim=0)
        out[r] = F.scaled_dot_product_attention(query[r][:, None], k, v, scale=scale)[:, 0]
    return out


# (query heads, KV heads, head dim): groups of 3 (SmolLM2-135M, 9 / 3), 6 and 7 (Qwen2.5)
# beside the powers of two, at dims 64 and 128
@pytest.mark.parametrize(
    "hq,hkv,d", [(9, 3, 64), (6, 1, 64), (14, 2, 128), (3, 1, 128), (8, 2, 64), (4, 4, 128)]
)
@pytest.mark.parametrize("level", _LEVELS)
def test_decode_attention_matches_sdpa_in_every_build(builds, level, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * 1000 + d)
    n, cap = 3, 140  # lengths cross the kernel's 64-position blocks
    layer = torch.randn(2, n, hkv, cap, d, generator=gen)
    query = torch.randn(n, hq, d, generator=gen)
    lens = torch.tensor([1, 65, 140])
    got = builds[level].decode_attention(query, layer, lens, d**-0.5, None)
    torch.testing.assert_close(got, _sdpa(query, layer, lens, d**-0.5), rtol=1e-5, atol=1e-5)
