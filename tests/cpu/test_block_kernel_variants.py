"""The block products (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) in every build this CPU can run,
against gguf's numpy de-quantization of the same blocks.

Each build (what the engine builds here; on an AVX-512 CPU the same without VNNI; AVX2,
and AVX2 with AVX-VNNI where the CPU has it; plain C) multiplies the blocks of random weights by quantized activations, one row (the
batch-1 decode step's one-row kernels) and several, on one thread and on two; the
reference is the float64 sum of gguf's de-quantized weight times the same 8-bit
activations.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest
import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.testing.quantizers import quantize_k
from enginecore_cpu import cpu_kernels, kquant_kernels, quant_kernels
from tests.helpers.kernel_builds import build_for

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.skipif(quant_kernels.load() is None, reason="no C compiler")

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX512 = _X86 and cpu_kernels.instruction_set() == "x86-64-v4"
_AVX_VNNI = (
    _X86
    and cpu_kernels.instruction_set() in ("x86-64-v3", "x86-64-v4")
    and "avx_vnni" in cpu_kernels._cpu_signature().split()
)
# (name, x86-64 level or None for the engine's own build)
_BUILDS = [
    ("host", None),
    *([("x86-64-v4 without VNNI", "x86-64-v4")] if _AVX512 else []),
    *([("x86-64-v3 with AVX-VNNI", "x86-64-v3+avxvnni")] if _AVX_VNNI else []),
    *([("x86-64-v3", "x86-64-v3"), ("x86-64", "x86-64")] if _X86 else []),
]


@pytest.fixture(scope="module")
def builds() -> dict[str, ctypes.CDLL]:
    """Both K-quant sources compiled for every build in ``_BUILDS``, loaded (compiled side
    by side: each compiler runs on a core of its own)."""
    jobs = {
        f"{name}/{source.stem}": ("host" if level is None else level, source)
        for name, level in _BUILDS
        for source in (kquant_kernels.SOURCE, quant_kernels.SOURCE)
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(build_for, *job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def _p(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def _high(lib: ctypes.CDLL, fmt: str) -> str:
    """The layout of a ``fmt`` weight's high bits a ``kquant_kernels`` build reads (Q4_K
    has none: planes)."""
    if fmt == "Q4_K":
        return kquant_blocks.PLANES
    packed = getattr(lib, f"eck_q{fmt[1]}_packed")
    packed.restype = ctypes.c_int64
    return kquant_blocks.PACKED if packed() else kquant_blocks.PLANES


# Each format with the shapes its rows can have: 1184 (an odd count of 32-value blocks)
# only for the 32-value formats, since a K-quant row is whole super-blocks of 256.
_FORMAT_SHAPES = [
    (fmt, shape)
    for fmt in ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
    for shape in [(13, 256), (6, 1280), (40, 2048), (7, 1184), (49, 576), (5, 2304)]
    if not (fmt.endswith("_K") and shape[1] % 256)
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("fmt", "shape"), _FORMAT_SHAPES)
@pytest.mark.parametrize("build", [name for name, _ in _BUILDS])
def test_k_quant_product_matches_gguf_dequantization(builds, build, fmt, shape, rows, threads):
    n, k = shape
    torch.manual_seed(n * k + rows)
    w = torch.randn(n, k)
    if fmt.endswith("_K"):
        raw = quantize_k(w, fmt)
        high = _high(builds[f"{build}/kquant_kernels"], fmt)  # in the build's layout
        part: Any = kquant_blocks.from_gguf(torch.from_numpy(raw), fmt, (n, k), high)
    else:
        raw = gguf_quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
        part = gguf_blocks.from_gguf(torch.from_numpy(raw).reshape(n, -1), fmt, (n, k))
    weight = np.asarray(gguf_quants.dequantize(raw, GGMLQuantizationType[fmt]), np.float64)
    x = torch.randn(rows, k) * torch.logspace(-2, 2, k)  # blocks of unlike scales
    acts = quant_kernels.load().quantize_rows(x)
    x_values = (acts.q.reshape(rows, -1, 32).double() * acts.scale.double()[..., None]).reshape(
        rows, k
    )
    want = x_values @ torch.from_numpy(weight.reshape(n, k)).T
    got = torch.full((rows, n + 3), float("nan"))  # a row stride beyond the outputs
    i64 = ctypes.c_int64
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if fmt in ("Q8_0", "Q4_0", "Q4_1", "Q4_K"):
            lib = builds[f"{build}/quant_kernels"]
            lib.ecq_linear.restype = ctypes.c_int
            qs, d, m = (ctypes.c_void_p(a) for a in part.pointers)
            status = lib.ecq_linear(
                ctypes.c_int(part.kind), _p(x), i64(k), i64(rows), i64(n), i64(k), qs, d, m,
                _p(got), i64(n + 3),
            )  # fmt: skip
            assert status == 0
        else:
            builds[f"{build}/kquant_kernels"].eck_gemm_k(
                i64(rows), i64(n), i64(k), i64(part.bits), _p(part.qs), _p(part.scales),
                _p(acts.q), _p(acts.scale), _p(acts.scaled_sum), _p(got), i64(n + 3),
            )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    scale = want.abs().max().item()
    assert (got[:, :n].double() - want).abs().max().item() <= 2e-6 * scale, (build, fmt)
    assert got[:, n:].isnan().all()  # nothing written past the outputs


def _linear(lib: ctypes.CDLL, part: Any, x: torch.Tensor) -> torch.Tensor:
    rows, k = x.shape
    n = part.shape[0]
    out = torch.full((rows, n), float("nan"))
    i64 = ctypes.c_int64
    qs, d, m = (ctypes.c_void_p(a) for a in part.pointers)
    lib.ecq_linear.restype = ctypes.c_int
    status = lib.ecq_linear(
        ctypes.c_int(part.kind), _p(x), i64(k), i64(rows), i64(n), i64(k), qs, d, m, _p(out),
        i64(n),
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.skipif(not _AVX512, reason="the CPU has no AVX-512")
@pytest.mark.parametrize("k", [256, 1280, 2048])
@pytest.mark.parametrize("n", [1, 3, 4, 13, 40])
@pytest.mark.parametrize("build", [name for name, level in _BUILDS if level in (None, "x86-64-v4")])
def test_q4_k_one_row_gives_the_many_row_kernels_bits(builds, build, n, k):
    """On AVX-512 the one-row Q4_K product (weight rows several at a time, two
    super-blocks' scales at a time in vector registers) gives each output the bits the
    many-row kernel gives that row (scales expanded to float32 a row, the same sums in the
    same order): every tail of weight rows and an odd count of super-blocks (1280)."""
    torch.manual_seed(n * k)
    w = torch.randn(n, k)
    part = kquant_blocks.from_gguf(torch.from_numpy(quantize_k(w, "Q4_K")), "Q4_K", (n, k))
    x = torch.randn(3, k) * torch.logspace(-2, 2, k)
    lib = builds[f"{build}/quant_kernels"]
    one = torch.cat([_linear(lib, part, x[r : r + 1]) for r in range(3)])
    many = _linear(lib, part, x)
    assert torch.equal(one.view(torch.int32), many.view(torch.int32)), build


def _q4_part(fmt: str, n: int, k: int) -> gguf_blocks.BlockWeight:
    """A Q4_0 or Q4_1 weight of random values; "Q4_1 float32" is Q4_1's with its scales
    and offsets as float32 (the kernels' third way of reading them)."""
    w = torch.randn(n, k)
    raw = gguf_quants.quantize(w.numpy(), GGMLQuantizationType[fmt.split()[0]])
    part = gguf_blocks.from_gguf(torch.from_numpy(raw).reshape(n, -1), fmt.split()[0], (n, k))
    if fmt.endswith("float32"):
        part = gguf_blocks.BlockWeight(4, part.qs, part.d.float(), part.m.float(), (n, k))
    return part


@pytest.mark.skipif(not _AVX512, reason="the CPU has no AVX-512")
@pytest.mark.parametrize("k", [32, 64, 96, 160, 576, 1184, 1248, 1536, 2048, 2080, 4000, 6176])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 13, 40])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_1 float32"])
@pytest.mark.parametrize("build", [name for name, level in _BUILDS if level in (None, "x86-64-v4")])
def test_q4_one_row_gives_the_many_row_kernels_bits(builds, build, fmt, n, k):
    """On AVX-512 the one-row Q4_0 / Q4_1 product (four weight rows a pass, two for longer
    rows: 4000 inputs, one at a time beyond: 6176) gives each output the bits the many-row kernel
    gives that row: every tail of weight rows (a pass's and the rest) and of blocks
    (groups of 4, then 2, then 1: 1, 2, 3, 5, 37, 39, 64, 65, 125, 193 blocks), for float16
    scales, Q4_0's offsets formed from them, and float32 ones."""
    torch.manual_seed(n * k)
    part = _q4_part(fmt, n, k)
    assert part.kind == {"Q4_0": 21, "Q4_1": 20, "Q4_1 float32": 4}[fmt]
    x = torch.randn(3, k) * torch.logspace(-2, 2, k)
    lib = builds[f"{build}/quant_kernels"]
    one = torch.cat([_linear(lib, part, x[r : r + 1]) for r in range(3)])
    many = _linear(lib, part, x)
    assert torch.equal(one.view(torch.int32), many.view(torch.int32)), build


def _weight(fmt: str, w: torch.Tensor) -> Any:
    """``w`` [n, k] as ``fmt``'s blocks as the kernels take them ("Q4_1 float32": Q4_1's
    scales and offsets as float32). Each row's blocks are quantized on their own, so a
    slice of ``w``'s rows gives the same rows of blocks."""
    n, k = w.shape
    name = fmt.split()[0]
    if name == "Q4_K":
        return kquant_blocks.from_gguf(torch.from_numpy(quantize_k(w, name)), name, (n, k))
    raw = gguf_quants.quantize(w.numpy(), GGMLQuantizationType[name])
    part = gguf_blocks.from_gguf(torch.from_numpy(raw).reshape(n, -1), name, (n, k))
    if fmt.endswith("float32"):
        part = gguf_blocks.BlockWeight(4, part.qs, part.d.float(), part.m.float(), (n, k))
    return part


# Row lengths for the one-row passes: 32-value blocks 1, 2, 3, 5, 8, 18, 37, 39, 48, 64,
# 65, 96, 97, 125 and 193 (every tail of a row's groups of 8, 4 and 2 blocks; Q8_0's
# two-row passes from 1536 to 3072 inputs, one row at a time either side; four-row passes
# up to 3072 inputs of Q4_0 / Q4_1, two-row passes beyond and AVX2's Q4_K's, one row at
# a time from 6145 inputs); Q4_K's whole super-blocks 1, 5 (odd), 8 and 9.
_PASS_SHAPES = [
    (fmt, k)
    for fmt in ["Q8_0", "Q4_0", "Q4_1", "Q4_1 float32", "Q4_K"]
    for k in (
        [256, 1280, 2048, 2304]
        if fmt == "Q4_K"
        else [32, 64, 96, 160, 256, 576, 1184, 1248, 1536, 2048, 2080, 3072, 3104, 4000, 6176]
    )
]


@pytest.mark.parametrize("n", [1, 3, 5, 13, 40])
@pytest.mark.parametrize(("fmt", "k"), _PASS_SHAPES)
@pytest.mark.parametrize("build", [name for name, _ in _BUILDS])
def test_one_row_passes_give_each_row_its_own_bits(builds, build, fmt, n, k):
    """The one-row (batch-1 decode) products take several weight rows a pass (every
    build's Q8_0, the AVX-512 and the AVX2 builds' 4-bit formats), the last rows of a
    product one at a time: each output has the bits of its weight row multiplied alone,
    for every tail of rows (a pass's and the rest) and of blocks, so each row's sum runs
    in one order whichever pass takes it. Q8_0's are also the many-row kernel's (one
    accumulator a row, block after block: the order its one-row product had)."""
    torch.manual_seed(n * k)
    w = torch.randn(n, k)
    x = torch.randn(1, k) * torch.logspace(-2, 2, k)
    lib = builds[f"{build}/quant_kernels"]
    together = _linear(lib, _weight(fmt, w), x)
    alone = torch.cat([_linear(lib, _weight(fmt, w[i : i + 1]), x) for i in range(n)], dim=1)
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32)), build
    if fmt == "Q8_0":
        many = _linear(lib, _weight(fmt, w), torch.cat([x, x.flip(1), x]))[:1]
        assert torch.equal(together.view(torch.int32), many.view(torch.int32)), build


@pytest.mark.skipif(not _X86, reason="the several-rows passes are the x86 builds'")
@pytest.mark.parametrize("build", [name for name, level in _BUILDS if level != "x86-64"])
def test_q8_one_row_passes_run_far_enough_ahead(builds, build):
    """The one-row Q8_0 product prefetches the next pass's bytes, so a pass's bytes are
    how far ahead it reads: a small model's LM head (576 inputs) takes its rows one at a
    time, each prefetching ahead of its own loads (a pass of four rows there read slower
    from memory), two rows a pass only where they span 3-6 KB, never four."""
    rows = builds[f"{build}/quant_kernels"].ecq_q8_pass_rows
    rows.argtypes, rows.restype = [ctypes.c_int64], ctypes.c_int
    passes = {k: rows(k) for k in range(32, 8193, 32)}
    assert passes[576] == 1 and passes[1184] == 1, build
    assert passes[1536] == 2 and passes[2048] == 2 and passes[3072] == 2, build
    assert passes[3104] == 1 and passes[8192] == 1, build
    assert set(passes.values()) == {1, 2}, build


@pytest.mark.skipif(not _X86, reason="the several-rows passes are the x86 builds'")
@pytest.mark.parametrize("build", [name for name, level in _BUILDS if level != "x86-64"])
def test_q8_one_row_passes_prefetch_as_far_ahead_as_one_row(builds, build):
    """A pass's prefetch stream (the next pass's bytes, in order) reaches the first line
    of the next pass's last row only a row's bytes of its reading before that line's
    load: the stream starts further on, so that at every width every weight line is
    prefetched at least as far ahead as one row at a time prefetches (PREFETCH_BYTES,
    4 KB), where two rows of 2,048 inputs had 2 KB."""
    lib = builds[f"{build}/quant_kernels"]
    lead = lib.ecq_q8_prefetch_lead
    lead.argtypes, lead.restype = [ctypes.c_int64], ctypes.c_int64
    rows = lib.ecq_q8_pass_rows
    rows.argtypes, rows.restype = [ctypes.c_int64], ctypes.c_int
    passes = [k for k in range(32, 8193, 32) if rows(k) == 2]
    assert passes == list(range(1536, 3073, 32)), build
    assert {k: lead(k) for k in range(32, 8193, 32)} == dict.fromkeys(range(32, 8193, 32), 4096)


@pytest.mark.skipif(not _AVX512, reason="the CPU has no AVX-512")
@pytest.mark.parametrize("build", [name for name, level in _BUILDS if level in (None, "x86-64-v4")])
def test_q4_one_row_passes_of_short_rows_go_one_at_a_time(builds, build):
    """The AVX-512 one-row Q4_0 / Q4_1 product prefetches the next pass's bytes: rows
    whose four-row pass spans under 3 KB (a small model's 576 inputs) go one at a time,
    each prefetching ahead of its own loads; four rows a pass from 3 KB (1,536 inputs)
    to 6 KB, two to 12 KB, one beyond."""
    rows = builds[f"{build}/quant_kernels"].ecq_q4_pass_rows
    rows.argtypes, rows.restype = [ctypes.c_int64], ctypes.c_int
    assert [rows(k) for k in (576, 1504, 1536, 2048, 3072, 3104, 6144, 6176)] == [
        1,
        1,
        4,
        4,
        4,
        2,
        2,
        1,
    ], build


def _instructions(path: str) -> str:
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.skipif(
    not (_AVX512 and {"avx512_vnni", "gfni"} <= set(cpu_kernels._cpu_signature().split())),
    reason="the CPU has no AVX-512 VNNI and GFNI",
)
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the build")
def test_the_avx512_build_takes_gfni(builds):
    """On an AVX-512 CPU with VNNI and GFNI the engine builds the block kernels with GFNI:
    the one-row Q6_K product spreads its high bits with ``vgf2p8affineqb``, the one-row
    Q4_K product takes its high nibbles with it (the build without VNNI, also tested
    above, keeps the masked adds and the shift and mask)."""
    assert quant_kernels._vnni() == ("vnni-gfni", ["-mavx512vnni", "-mgfni"])
    for source in ("kquant_kernels", "quant_kernels"):
        assert "vgf2p8affineqb" in _instructions(builds[f"host/{source}"]._name), source
        assert "vgf2p8affineqb" not in _instructions(
            builds[f"x86-64-v4 without VNNI/{source}"]._name
        )


@pytest.mark.skipif(not _AVX_VNNI, reason="the CPU has no AVX-VNNI")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the build")
@pytest.mark.parametrize("source", ["quant_kernels", "kquant_kernels"])
def test_the_avx2_build_takes_avx_vnni(builds, monkeypatch, source):
    """On an AVX2 CPU with AVX-VNNI the engine builds the block kernels with it, and their
    one-row products take its dot product (one ``vpdpbusd`` where AVX2 takes
    ``vpmaddubsw`` and ``vpmaddwd``)."""
    monkeypatch.setattr(cpu_kernels, "instruction_set", lambda: "x86-64-v3")
    assert quant_kernels._vnni() == ("avxvnni", ["-mavxvnni"])
    assert "vpdpbusd" in _instructions(builds[f"x86-64-v3 with AVX-VNNI/{source}"]._name)


@pytest.mark.parametrize("fmt", ["Q5_K", "Q6_K"])
def test_the_avx2_build_reads_high_bits_packed(builds, fmt):
    """The x86-64-v3 builds (AVX2, no AVX-512 byte masks or GFNI) keep Q5_K's 5th bits eight
    values a byte and Q6_K's high bits two a value, as the file's ``qh`` packs them; every
    other build the bit planes; the engine knows its build's layout without building it."""
    for name, level in _BUILDS:
        packed = (level or cpu_kernels.instruction_set()).startswith("x86-64-v3")
        want = kquant_blocks.PACKED if packed else kquant_blocks.PLANES
        assert _high(builds[f"{name}/kquant_kernels"], fmt) == want, name
    known = {"Q5_K": kquant_kernels.q5_high, "Q6_K": kquant_kernels.q6_high}[fmt]()
    assert known == _high(builds["host/kquant_kernels"], fmt)
    assert kquant_kernels.load().high(fmt) == known


# Bytes of a super-block, and where its float16 scales lie
_SUPER_BYTES = {"Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _k_inputs(fmt: str, n: int, k: int, rows: int) -> tuple[torch.Tensor, ...]:
    """A ``fmt`` file's rows [n, bytes] and quantized activations (bytes, block scales,
    their scaled sums) of fixed values: numpy's PCG64 stream of a fixed seed."""
    rng = np.random.default_rng(45)
    size, halves = _SUPER_BYTES[fmt]
    blocks = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    for at in halves:
        scales = rng.uniform(1e-3, 2e-2, size=n * k // 256).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    xq = rng.integers(-127, 128, size=(rows, k), dtype=np.int8)
    xd = rng.uniform(1e-3, 1.0, size=(rows, k // 32)).astype(np.float32)
    xs = (xd * xq.reshape(rows, -1, 32).sum(-1, dtype=np.int32)).astype(np.float32)
    tensors = (blocks.reshape(n, -1), xq, xd, xs)
    return tuple(torch.from_numpy(np.ascontiguousarray(t)) for t in tensors)


# sha256 of the float32 outputs of the AVX2 build's products (one activation row, then
# three) on ``_k_inputs(fmt, 40, 2304, 3)``, and of Q5_K's de-quantized weight, as the
# kernels gave them on the bit-plane layout
_AVX2_Q5_K_WEIGHT = "18e36071c796ff5696597b534584b3829afaa80eef066c3aef878e8843bc108d"
_AVX2_BITS = {
    "Q5_K": {
        1: "5b7beb603ebf96ca099c08d58b6c4b2408fdaae8873359467f1724af821397ca",
        3: "4c2a6d20f7d2bd17e2c89f3d9b326856532093bc6f224637ec42db1a70a35699",
    },
    "Q6_K": {
        1: "9462f8aae7f3984dc075aaa5e85704f835d6e62840bbc4f476e0a47628dbb814",
        3: "054dac27524bf23d3c47fc5ccd1feb69d383105210b3eee63fdcdcf7efe89ea1",
    },
}


@pytest.mark.skipif(not _X86, reason="the AVX2 build is x86's")
@pytest.mark.parametrize("fmt", list(_AVX2_BITS))
@pytest.mark.parametrize("build", [n for n, lv in _BUILDS if (lv or "").startswith("x86-64-v3")])
def test_the_avx2_k_quant_products_keep_their_bits(builds, build, fmt):
    """The AVX2 build's Q5_K and Q6_K products, one-row and many-row, and Q5_K's
    de-quantization give the bits they gave before their high bits were packed: the
    file's blocks through the build's own repacking, then its kernels."""
    n, k = 40, 2304
    lib = builds[f"{build}/kquant_kernels"]
    raw, xq, xd, xs = _k_inputs(fmt, n, k, 3)
    part = kquant_blocks.empty_weight(fmt, (n, k), high=_high(lib, fmt))
    i64 = ctypes.c_int64
    lib.eck_repack_k(
        i64(part.bits), i64(n), i64(k), _p(raw), i64(raw.stride(0)), None, _p(part.qs),
        _p(part.scales),
    )  # fmt: skip
    for rows, digest in _AVX2_BITS[fmt].items():
        out = torch.empty(rows, n)
        lib.eck_gemm_k(
            i64(rows), i64(n), i64(k), i64(part.bits), _p(part.qs), _p(part.scales),
            _p(xq[:rows]), _p(xd[:rows]), _p(xs[:rows]), _p(out), i64(n),
        )  # fmt: skip
        assert hashlib.sha256(out.numpy().tobytes()).hexdigest() == digest, rows
    if fmt == "Q5_K":
        weight = torch.empty(n, k)
        lib.eck_dequantize_k(
            i64(n), i64(k), i64(part.bits), _p(part.qs), _p(part.scales), _p(weight)
        )
        assert hashlib.sha256(weight.numpy().tobytes()).hexdigest() == _AVX2_Q5_K_WEIGHT
