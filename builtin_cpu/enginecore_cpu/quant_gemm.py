"""Loader of ``quant_gemm.c``: many-row products (prefill) over the block-quantized
weights the ``gguf`` linear method keeps, each weight block decoded once a call and used
for every activation row. Built per x86-64 level as ``cpu_kernels`` is, with the CPU's
VNNI (AVX-512 VNNI, or AVX-VNNI on an AVX2 CPU) where it has one (the file name says so)."""

from __future__ import annotations

import ctypes
import logging
from ctypes import c_int64, c_void_p
from pathlib import Path

import torch

from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore_cpu import cpu_kernels, quant_kernels
from enginecore_cpu.quant_kernels import QuantizedActivations

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quant_gemm.c")

_P, _I64 = c_void_p, c_int64
_SIGNATURE = (ctypes.c_int, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _I64)


def extra_isa() -> tuple[str, list[str]] | None:
    """The VNNI this CPU adds to its x86-64 level: AVX-512 VNNI on level 4, AVX-VNNI on
    level 3 (a suffix of the file name and the compiler flag)."""
    return quant_kernels._vnni()


class QuantGemm:
    def __init__(self, path: Path, vnni: bool) -> None:
        self.vnni = vnni  # built with VNNI's dot product (AVX-512 VNNI or AVX-VNNI)
        self.lib = ctypes.CDLL(str(path))
        self._gemm = self.lib.ecg_gemm
        self._gemm.argtypes, self._gemm.restype = _SIGNATURE, ctypes.c_int
        self.path = path

    def gemm(
        self, acts: QuantizedActivations, weight: BlockWeight | KQuantWeight, out: torch.Tensor
    ) -> None:
        """``out`` [M, N] (innermost contiguous) = x W^T for the activations ``acts``
        (``QuantKernels.quantize_rows``) and any block ``weight`` the ``gguf`` method
        keeps."""
        rows, k = acts.q.shape
        qs, d, m = weight.pointers
        failed = self._gemm(
            weight.kind, rows, weight.shape[0], k, qs, d, m, acts.q.data_ptr(),
            acts.scale.data_ptr(), acts.scaled_sum.data_ptr(), out.data_ptr(), out.stride(0),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no scratch memory for a {weight.shape[0]}x{k} weight's panels")


def build(directory: Path | None = None, only_path: bool = False) -> Path:
    """Compile the library into the cache (if not there yet); its path (with
    ``only_path``, compiling nothing)."""
    return cpu_kernels.build(
        directory,
        source=SOURCE,
        stem="enginecore_quant_gemm",
        extra_isa=extra_isa(),
        only_path=only_path,
    )


library: cpu_kernels.BuildOnce[QuantGemm] = cpu_kernels.BuildOnce(
    lambda: QuantGemm(build(), vnni=extra_isa() is not None),
    warning="many-row quantized CPU kernels unavailable",
    switch=quant_kernels.ENV_SWITCH,
    log=logger,
    target=lambda: build(only_path=True),
    build=build,
)


def load() -> QuantGemm | None:
    """The kernels, built on first call; None when switched off (the switch of
    ``quant_kernels``) or unbuildable (the ``gguf`` method then takes its other paths)."""
    return library()
