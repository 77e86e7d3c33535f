"""The many-row product over quantized blocks (``quant_gemm.c``, prefill) in every build
this CPU can run, against gguf's numpy de-quantization and against the one-row kernels.

Each build (what the engine builds here; on an AVX-512 CPU the same without VNNI; AVX2
with AVX-VNNI where the CPU has it; AVX2; plain C) multiplies random weights in each
block format by activation rows quantized as the engine does, at row counts that leave
every tail of its row tiles and a partial panel of 16 outputs, on one thread and on two.
The integer sums are the one-row kernels'; the float sums run in another order, so both
are held to the float64 sum of the same products: within 2e-6 of the largest output
(docs/quantization.md).
"""

from __future__ import annotations

import ctypes
import pathlib
import platform
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.testing.quantizers import quantize_k
from enginecore_cpu import cpu_kernels, kquant_kernels, quant_gemm, quant_kernels

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.skipif(quant_gemm.load() is None, reason="no C compiler")

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_FLAGS = set(cpu_kernels._cpu_signature().split())
_AVX512 = _X86 and cpu_kernels.instruction_set() == "x86-64-v4"
_AVX2 = _X86 and cpu_kernels.instruction_set() in ("x86-64-v3", "x86-64-v4")
# (name, x86-64 level or None for the engine's own build, extra instructions)
_BUILDS: list[tuple[str, str | None, tuple[str, list[str]] | None]] = [
    ("host", None, quant_gemm.extra_isa()),
    *([("x86-64-v4 without VNNI", "x86-64-v4", None)] if _AVX512 else []),
    *(
        [("x86-64-v3 with AVX-VNNI", "x86-64-v3", ("avxvnni", ["-mavxvnni"]))]
        if _AVX2 and "avx_vnni" in _FLAGS
        else []
    ),
    *([("x86-64-v3", "x86-64-v3", None)] if _AVX2 else []),
    *([("x86-64", "x86-64", None)] if _X86 else []),
]
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 19]  # every tail of 4- and 8-row tiles


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    out: dict[str, ctypes.CDLL] = {}
    own_level = cpu_kernels.instruction_set
    for name, level, extra_isa in _BUILDS:
        directory = tmp_path_factory.mktemp(name.replace(" ", "-"))
        shutil.copy(quant_gemm.SOURCE.with_name("quant_simd.h"), directory)
        copy = pathlib.Path(shutil.copy(quant_gemm.SOURCE, directory))
        try:
            if level is not None:
                cpu_kernels.instruction_set = lambda level=level: level  # type: ignore[method-assign]
            path = cpu_kernels.build(directory, source=copy, stem=copy.stem, extra_isa=extra_isa)
        finally:
            cpu_kernels.instruction_set = own_level  # type: ignore[method-assign]
        lib = ctypes.CDLL(str(path))
        lib.ecg_gemm.restype = ctypes.c_int
        out[name] = lib
    return out


def _high(build: str) -> str:
    """The layout of Q5_K's and Q6_K's high bits ``build`` reads: packed on x86-64-v3."""
    level = next(lv for name, lv, _ in _BUILDS if name == build) or cpu_kernels.instruction_set()
    return kquant_blocks.PACKED if level == "x86-64-v3" else kquant_blocks.PLANES


def _weight(fmt: str, n: int, k: int, high: str) -> tuple[Any, Any, np.ndarray]:
    """Random weights in ``fmt`` as a build keeps them (Q5_K's and Q6_K's high bits in
    ``high``) and as the engine's one-row kernels do, and gguf's de-quantization."""
    w = torch.randn(n, k)
    if fmt.endswith("_K"):
        raw = quantize_k(w, fmt)
        part: Any = kquant_blocks.from_gguf(torch.from_numpy(raw), fmt, (n, k), high)
        assert part.high == (kquant_blocks.PLANES if fmt == "Q4_K" else high)
        engines: Any = kquant_kernels.load().from_gguf(torch.from_numpy(raw), fmt, (n, k))
    else:
        raw = gguf_quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
        part = engines = gguf_blocks.from_gguf(torch.from_numpy(raw).reshape(n, -1), fmt, (n, k))
    reference = np.asarray(gguf_quants.dequantize(raw, GGMLQuantizationType[fmt]), np.float64)
    return part, engines, reference.reshape(n, k)


def _one_row_kernels(part: Any, x: torch.Tensor, acts: Any) -> torch.Tensor:
    """The engine's own one-row kernels' product (four rows at a time)."""
    out = torch.empty(x.shape[0], part.shape[0])
    if isinstance(part, kquant_blocks.KQuantWeight) and part.fmt != "Q4_K":
        kquant_kernels.load().gemm_k(acts, part, out)
    else:
        quant_kernels.load().linear(x, part, out)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(13, 256), (40, 2048), (70, 512)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("build", [name for name, _, _ in _BUILDS])
def test_gemm_matches_gguf_dequantization_and_the_one_row_kernels(
    builds, build, fmt, shape, threads
):
    n, k = shape
    torch.manual_seed(n * k)
    part, engines, weight = _weight(fmt, n, k, _high(build))
    qs, d, m = (ctypes.c_void_p(p) for p in part.pointers)
    i64, ptr = ctypes.c_int64, lambda t: ctypes.c_void_p(t.data_ptr())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ROWS:
            x = torch.randn(rows, k) * torch.logspace(-2, 2, k)  # blocks of unlike scales
            acts = quant_kernels.load().quantize_rows(x)
            x_values = acts.q.reshape(rows, -1, 32).double() * acts.scale.double()[..., None]
            want = x_values.reshape(rows, k) @ torch.from_numpy(weight).T
            got = torch.full((rows, n + 3), float("nan"))  # a row stride beyond the outputs
            status = builds[build].ecg_gemm(
                ctypes.c_int(part.kind), i64(rows), i64(n), i64(k), qs, d, m, ptr(acts.q),
                ptr(acts.scale), ptr(acts.scaled_sum), ptr(got), i64(n + 3),
            )  # fmt: skip
            assert status == 0
            bound = 2e-6 * want.abs().max().item()
            assert (got[:, :n].double() - want).abs().max().item() <= bound, (build, fmt, rows)
            assert got[:, n:].isnan().all()  # nothing written past the outputs
            one_row = _one_row_kernels(engines, x, acts).double()
            assert (got[:, :n].double() - one_row).abs().max().item() <= 2 * bound
    finally:
        torch.set_num_threads(before)


def test_the_engine_builds_the_cpus_vnni():
    """The engine's build takes the CPU's VNNI (AVX-512 VNNI, with GFNI where the CPU has
    it, else AVX-VNNI) where it has one, and says so in its file name."""
    name = quant_gemm.load().path.name
    if _AVX512 and "avx512_vnni" in _FLAGS:
        assert ("-vnni-gfni_" if "gfni" in _FLAGS else "-vnni_") in name
    elif _AVX2 and "avx_vnni" in _FLAGS and not _AVX512:
        assert "-avxvnni_" in name
    else:
        assert "vnni" not in name
