"""The fused CPU kernels against the torch ops they replace, and their fallback.

Greedy equality with transformers through the kernels is covered by the model suites
(test_llm_correctness, test_models_vs_transformers, ...), which run float32 on CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from enginecore.layers import RMSNorm, RotaryEmbedding
from enginecore.layers.fused_ops import NO_FUSED_OPS
from enginecore_cpu import cpu_kernels
from enginecore_cpu.fused_ops import CpuFusedOps

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: kernels unavailable")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_rms_norm_matches_torch(gen):
    x = torch.randn(37, 256, generator=gen)
    w = torch.randn(256, generator=gen)
    ours = KERNELS.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(ours, F.rms_norm(x, (256,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_adds_the_residual_in_place(gen):
    x = torch.randn(5, 64, generator=gen)
    residual = torch.randn(5, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    expected_sum = residual + x
    ours = KERNELS.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(residual, expected_sum)  # the stream itself, updated in place
    torch.testing.assert_close(ours, F.rms_norm(expected_sum, (64,), w, 1e-5))


def test_add_and_norm_falls_back_for_bf16(gen):
    norm = RMSNorm(64, 1e-6, torch.bfloat16)
    norm.fused_ops = CpuFusedOps()
    norm.weight.data.copy_(torch.randn(64, generator=gen))
    x = torch.randn(3, 64, generator=gen).bfloat16()
    residual = torch.randn(3, 64, generator=gen).bfloat16()
    before = residual.clone()
    normed, stream = norm.add_and_norm(x, residual)
    assert torch.equal(residual, before)  # the torch path never writes the caller's tensor
    assert torch.equal(stream, before + x)
    assert torch.equal(normed, norm(before + x))


def _rotary_reference(rotary: RotaryEmbedding, positions, x, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(rotary, "fused_ops", NO_FUSED_OPS)
        return rotary(positions, x)


def test_rotary_in_place_matches_the_torch_path(gen, monkeypatch):
    rotary = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    rotary.fused_ops = CpuFusedOps()
    qkv = torch.randn(9, (4 + 2 + 2) * 64, generator=gen)
    qk = qkv[:, : 6 * 64].view(9, 6, 64)  # Q and K heads inside the fused projection
    positions = torch.randint(0, 512, (9,), generator=gen)
    expected = _rotary_reference(rotary, positions, qk.clone(), monkeypatch)
    v_before = qkv[:, 6 * 64 :].clone()
    out = rotary(positions, qk)
    assert out.data_ptr() == qk.data_ptr()  # rotated where it lies
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(qkv[:, 6 * 64 :], v_before)  # V untouched


def test_rotary_rejects_a_position_beyond_the_table(gen):
    rotary = RotaryEmbedding(64, 16, {"rope_theta": 10000.0, "rope_type": "default"})
    rotary.fused_ops = CpuFusedOps()
    x = torch.randn(2, 2, 64, generator=gen)
    before = x.clone()
    with pytest.raises(IndexError, match="rotary table"):
        rotary(torch.tensor([3, 16]), x)
    assert torch.equal(x, before)


def test_silu_and_mul_matches_torch(gen):
    x = torch.randn(11, 2 * 96, generator=gen)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(KERNELS.silu_and_mul(x), F.silu(gate) * up)


def test_silu_and_mul_vector_lanes_and_tail_agree_bit_for_bit(gen):
    # 13 = one 8-lane vector + a 5-element scalar tail; each row's tail repeats its first
    # five gates, so both paths see the same values and must give the same bits.
    gate = torch.randn(40, 8, generator=gen) * 40
    gate[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 95.0, -95.0])
    gate = torch.cat([gate, gate[:, :5]], dim=1)
    up = torch.randn(40, 8, generator=gen)
    out = KERNELS.silu_and_mul(torch.cat([gate, torch.cat([up, up[:, :5]], dim=1)], dim=1))
    assert torch.equal(out[:, :5].view(torch.int32), out[:, 8:].view(torch.int32))
    ref = F.silu(gate) * torch.cat([up, up[:, :5]], dim=1)
    torch.testing.assert_close(out[1:], ref[1:])
    assert out[0, 0].isnan() and out[0, 1] == float("inf") * up[0, 1]


def test_write_kv_scatters_strided_heads(gen):
    cache = torch.zeros(2, 6, 4, 2, 8)
    qkv = torch.randn(3, 4 * 8 + 2 * 2 * 8, generator=gen)
    k = qkv[:, 32:48].view(3, 2, 8)
    v = qkv[:, 48:].view(3, 2, 8)
    slots = torch.tensor([0, 13, 23])
    KERNELS.write_kv(cache, k, v, slots)
    flat = cache.view(2, 24, 2, 8)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    assert int((flat.abs().sum(dim=(2, 3)) != 0).sum()) == 6
    with pytest.raises(IndexError, match="KV cache"):
        KERNELS.write_kv(cache, k, v, torch.tensor([0, 1, 24]))


def test_mirror_append_writes_each_row_at_its_length(gen):
    n, hkv, d, cap = 3, 2, 8, 16
    layer = torch.zeros(2, 4, hkv, cap, d)  # one spare row stays untouched
    qkv = torch.randn(n, 4 * d + 2 * hkv * d, generator=gen)
    k = qkv[:, 4 * d : 6 * d].view(n, hkv, d)
    v = qkv[:, 6 * d :].view(n, hkv, d)
    lens = torch.tensor([1, 9, 16])
    KERNELS.mirror_append(layer, k, v, lens)
    expected = torch.zeros_like(layer)
    for r in range(n):
        expected[0, r, :, lens[r] - 1] = k[r]
        expected[1, r, :, lens[r] - 1] = v[r]
    assert torch.equal(layer, expected)
    with pytest.raises(IndexError, match="capacity"):
        KERNELS.mirror_append(layer, k, v, torch.tensor([1, 0, 2]))
    assert torch.equal(layer, expected)  # a bad length writes nothing


def test_write_kv_and_mirror_append_split_over_threads_write_the_same(gen):
    """Enough tokens that the copies run on every torch thread: same bytes as torch's."""
    tokens, h, d, bs = 300, 2, 64, 16
    cache = torch.zeros(2, 40, bs, h, d)
    k = torch.randn(tokens, h, d, generator=gen)
    v = torch.randn(tokens, h, d, generator=gen)
    slots = torch.randperm(40 * bs, generator=gen)[:tokens]
    KERNELS.write_kv(cache, k, v, slots)
    expected = torch.zeros_like(cache).view(2, 40 * bs, h, d)
    expected[0].index_copy_(0, slots, k)
    expected[1].index_copy_(0, slots, v)
    assert torch.equal(cache.view_as(expected), expected)

    layer = torch.zeros(2, tokens, h, 8, d)
    lens = torch.randint(1, 9, (tokens,), generator=gen)
    KERNELS.mirror_append(layer, k, v, lens)
    rows = torch.arange(tokens)
    assert torch.equal(layer[0, rows, :, lens - 1], k)
    assert torch.equal(layer[1, rows, :, lens - 1], v)
    assert int((layer.abs().sum(dim=-1) != 0).sum()) == 2 * tokens * h


def test_mirror_fill_copies_each_request_context_from_its_blocks(gen):
    bs, h, d, cap = 4, 2, 8, 16
    cache = torch.randn(2, 10, bs, h, d, generator=gen)
    layer = torch.zeros(2, 5, h, cap, d)
    table = torch.tensor([[3, 7, 1], [9, 0, 0]])  # request 1 has one block (rest padding)
    lens = torch.tensor([10, 3])
    KERNELS.mirror_fill(layer, cache, table, lens, 2)
    for i, row in enumerate((2, 3)):
        slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs for p in range(lens[i])])
        gathered = cache.view(2, 10 * bs, h, d)[:, slots].transpose(1, 2)  # [2, H, len, D]
        assert torch.equal(layer[:, row, :, : lens[i]], gathered)
        assert not layer[:, row, :, lens[i] :].any()
    assert not layer[:, [0, 1, 4]].any()
    for bad_table, bad_lens, row0 in (
        (torch.tensor([[3, 10, 1], [9, 0, 0]]), lens, 2),  # a block id past the cache
        (table, torch.tensor([13, 3]), 2),  # more positions than the table's blocks
        (table, lens, 4),  # a row past the mirror
    ):
        with pytest.raises(IndexError, match="beyond the cache or the mirror"):
            KERNELS.mirror_fill(layer, cache, bad_table, bad_lens, row0)


@pytest.mark.parametrize("cols", [1, 7, 16, 33, 48, 8192])
def test_argmax_rows_matches_numpy_on_ties_nan_and_infinities(gen, cols):
    x = torch.randn(64, cols, generator=gen)
    x[1] = 1.0  # all tied: the first
    x[2] = float("-inf")
    x[3, cols // 2] = float("nan")  # a NaN wins, as in numpy
    x[4, -1] = float("nan")
    x[5] = x[5].round()  # ties among the largest
    x[6, 0] = float("inf")
    for rows in (x, torch.randn(64, 2 * cols, generator=gen)[:, :cols]):  # strided rows too
        assert torch.equal(KERNELS.argmax_rows(rows), torch.from_numpy(rows.numpy().argmax(1)))


def _mirror_attention(query, layer, lens, scale, window):
    """SDPA of each row on its own positions (the reference for decode_attention)."""
    n, hq, _ = query.shape
    hkv = layer.shape[2]
    out = torch.empty_like(query)
    for r in range(n):
        start = max(0, int(lens[r]) - window) if window else 0
        k = layer[0, r, :, start : lens[r]].repeat_interleave(hq // hkv, dim=0)
        v = layer[1, r, :, start : lens[r]].repeat_interleave(hq // hkv, dim=0)
        out[r] = F.scaled_dot_product_attention(query[r][:, None], k, v, scale=scale)[:, 0]
    return out


# (query heads, KV heads, head dim): the AVX-512 or AVX2 versions (dims 32, 64 and 128, 1
# to 8 query heads per KV head) and the portable one (any other dim, here with 6 per KV head).
@pytest.mark.parametrize(
    "hq,hkv,d",
    [(2, 1, 32), (8, 2, 32), (4, 2, 64), (8, 1, 64), (8, 8, 128), (16, 4, 128), (12, 2, 40)],
)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_attends_each_row_over_its_own_length(gen, hq, hkv, d, window):
    n, cap = 5, 150  # lengths cross the kernel's 64-position blocks
    layer = torch.randn(2, n + 1, hkv, cap, d, generator=gen)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    query = qkv[:, : hq * d].view(n, hq, d)  # a view with the QKV row stride
    lens = torch.tensor([1, 64, 65, 150, 17])
    got = KERNELS.decode_attention(query, layer, lens, d**-0.5, window)
    want = _mirror_attention(query, layer, lens, d**-0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match="capacity"):
        KERNELS.decode_attention(query, layer, torch.tensor([1, 2, 3, 151, 4]), 1.0, None)


needs_gemm = pytest.mark.skipif(
    KERNELS is None or not KERNELS.gemm_available(), reason="the GEMM tile needs AVX2 and FMA"
)


# Lengths across the 48-position query blocks and 16-key panels; (query heads, KV heads,
# head dim) with 1 to 6 query heads per KV head.
@needs_gemm
@pytest.mark.parametrize(
    "lens,hq,hkv,d",
    [
        ([128] * 5, 4, 2, 64),
        ([1, 5, 47, 48, 49, 131], 4, 2, 64),
        ([7, 97], 8, 8, 16),
        ([100], 12, 2, 128),
        ([300], 4, 1, 32),
    ],
)
def test_prefill_attention_is_causal_attention_of_each_prompt(gen, lens, hq, hkv, d):
    total = sum(lens) + 3  # rows past the prompts: left alone
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=gen)  # strided views, as in a step
    q = qkv[:, : hq * d].view(total, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(total, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(total, hkv, d)
    starts = torch.tensor([3 + sum(lens[:i]) for i in range(len(lens))])
    out = torch.full((total, hq, d), 7.0)
    KERNELS.prefill_attention(q, k, v, starts, torch.tensor(lens), d**-0.5, out)
    assert torch.equal(out[:3], torch.full((3, hq, d), 7.0))
    for first, n in zip(starts.tolist(), lens, strict=True):
        rows = slice(first, first + n)
        heads = [x[rows].transpose(0, 1).double() for x in (q, k, v)]
        want = F.scaled_dot_product_attention(
            *heads, is_causal=True, scale=d**-0.5, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[rows], want.float(), rtol=2e-5, atol=2e-5)


@needs_gemm
def test_prefill_attention_refuses_what_it_cannot_attend(gen):
    q, k, v = torch.randn(4, 2, 24), torch.randn(4, 1, 24), torch.randn(4, 1, 24)
    out = torch.empty(4, 2, 24)
    assert cpu_kernels.prefill_attention_max_len(KERNELS, 24) == 0
    assert cpu_kernels.prefill_attention_max_len(KERNELS, 64) == 1170  # 512 KiB per thread
    with pytest.raises(ValueError, match="multiple of 16"):
        KERNELS.prefill_attention(q, k, v, torch.tensor([0]), torch.tensor([4]), 1.0, out)
    q, k, v, out = (x[..., :16].contiguous() for x in (q, k, v, out))
    with pytest.raises(ValueError, match="non-empty"):
        KERNELS.prefill_attention(q, k, v, torch.tensor([0, 2]), torch.tensor([2, 0]), 1.0, out)


def test_only_float32_cpu_tensors_get_kernels():
    assert cpu_kernels.kernels_for(torch.zeros(2)) is KERNELS
    assert cpu_kernels.kernels_for(torch.zeros(2, dtype=torch.bfloat16)) is None
    # Every tensor a call touches: a bfloat16 weight beside float32 activations would be
    # read as floats past its end.
    assert cpu_kernels.kernels_for(torch.zeros(2), torch.zeros(2)) is KERNELS
    assert cpu_kernels.kernels_for(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)) is None


def _load_in_child(tmp_path, **env) -> str:
    code = (
        "import torch\n"
        "from enginecore_cpu import cpu_kernels\n"
        "print('loaded' if cpu_kernels.load() else 'fallback')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ENGINECORE_CACHE_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() + "\n" + done.stderr


def test_switched_off_by_the_environment(tmp_path):
    out = _load_in_child(tmp_path, ENGINECORE_CPU_KERNELS="0")
    assert out.startswith("fallback")
    assert not any(tmp_path.iterdir())  # nothing built


def test_a_failing_compiler_falls_back_with_a_warning(tmp_path):
    out = _load_in_child(tmp_path, CC="false")
    assert out.startswith("fallback")
    assert "fused CPU kernels unavailable" in out


def test_built_once_then_reused_from_the_cache(tmp_path):
    # The source's object from this session's cache: the first child links the library
    # (a build resumed from its objects) instead of compiling the source again.
    cpu_kernels.build()
    objects = tmp_path / "cpu_kernels" / "objects"
    objects.mkdir(parents=True)
    for cached in (cpu_kernels.cache_dir() / "cpu_kernels" / "objects").glob("cpu_kernels_*.o"):
        shutil.copy(cached, objects)
    assert _load_in_child(tmp_path).startswith("loaded")
    built = list((tmp_path / "cpu_kernels").glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _load_in_child(tmp_path).startswith("loaded")
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cpu_kernels").glob("*.so")] == [stamp]


@pytest.mark.parametrize(
    "flags,level",
    [
        ("fpu sse4_2 popcnt ssse3 avx avx2 fma bmi1 bmi2 f16c movbe", "x86-64-v3"),
        (
            "sse4_2 popcnt ssse3 avx2 fma bmi1 bmi2 f16c movbe avx512f avx512bw avx512cd "
            "avx512dq avx512vl",
            "x86-64-v4",
        ),
        ("sse4_2 popcnt ssse3", "x86-64-v2"),
    ],
)
def test_the_build_targets_the_cpus_x86_level_not_the_host(flags, level, monkeypatch, tmp_path):
    """A library built for a level runs on every CPU of that level it is copied to: the
    file is named by the level and the key holds no host-specific flag."""
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda: "flags : " + flags)
    assert cpu_kernels.instruction_set() == level
    commands = []

    def record(command, priority=0):
        commands.append(command)

    monkeypatch.setattr(cpu_kernels.kernel_cache, "run_compiler", record)
    monkeypatch.setattr(cpu_kernels.os, "replace", lambda src, dst: None)
    target = cpu_kernels.build(tmp_path)
    assert target.name.startswith(f"enginecore_cpu_kernels_{level}_")
    assert f"-march={level}" in commands[0] and "-march=native" not in commands[0]
    # Another CPU of the same level (other flags besides) gets the same file.
    monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda: "flags : " + flags + " rdrand")
    assert cpu_kernels.build(tmp_path) == target


def test_a_build_in_progress_is_waited_for_not_repeated(tmp_path, monkeypatch):
    """A first start compiles in the background while the weights load; a foreground
    ``build`` of the same library meanwhile waits for that compile instead of running
    the compiler again."""
    import shutil
    import threading

    log = tmp_path / "compiles"
    wrapper = tmp_path / "cc"
    compiler = shutil.which("cc") or shutil.which("gcc")
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nsleep 1\nexec {compiler} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    source = tmp_path / "tiny.c"
    source.write_text("int ec_tiny(void) { return 7; }\n")
    built: list[object] = []

    def build() -> object:
        path = cpu_kernels.build(tmp_path / "cache", source=source, stem="tiny")
        built.append(path)
        return path

    cpu_kernels.build_in_background(build)
    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(built) >= 2 and len(set(built)) == 1
    runs = log.read_text().splitlines()
    assert len([r for r in runs if "tiny.c" in r]) == 1  # one compile for three callers
    assert len(runs) == 2  # and one link
