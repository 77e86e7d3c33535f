"""Loader of ``quant_kernels.c``: products over block-quantized weights (the ``gguf``
linear method), built per x86-64 level as ``cpu_kernels`` is, with VNNI where the CPU has
it (the file name says so)."""

from __future__ import annotations

import ctypes
import logging
from ctypes import c_int64, c_void_p
from pathlib import Path

import torch

from enginecore.block_formats.gguf_blocks import (
    Q4_0_HALF_SCALES,
    Q4_HALF_SCALES,
    Q8_HALF_SCALES,
    BlockWeight,
)
from enginecore.block_formats.kquant_blocks import Q4_K_KIND, KQuantWeight
from enginecore_cpu import cpu_kernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quant_kernels.c")
ENV_SWITCH = "ENGINECORE_QUANT_KERNELS"
BLOCK = 32

_P, _I64 = c_void_p, c_int64
_SIGNATURES = {
    "ecq_quantize_rows": [_P, _I64, _I64, _I64, _P, _P, _P],
    "ecq_dequantize_q4": [_I64, _I64, _P, _P, _P, _P],
    "ecq_dequantize_q8": [_I64, _I64, _P, _P, _P],
    "ecq_dequantize_q4k": [_I64, _I64, _P, _P, _P],
}
_LINEAR_SIGNATURE = (ctypes.c_int, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64)
# What ``ecq_linear`` multiplies: 8-bit and 4-bit blocks with float32 or float16 scales
# (Q4_0's offsets formed from them), Q4_K's (the others read past a weight's scales)
_LINEAR_KINDS = frozenset({8, Q8_HALF_SCALES, 4, Q4_HALF_SCALES, Q4_0_HALF_SCALES, Q4_K_KIND})


def _vnni() -> tuple[str, list[str]] | None:
    """The VNNI this CPU adds to its x86-64 level, for every block kernel's build (a
    suffix of the file name and the compiler flags): AVX-512 VNNI on level 4 (with GFNI
    where the CPU has it), AVX-VNNI on
    level 3 (an AVX2 CPU that has it: its one-row products then take ``vpdpbusd`` as the
    AVX-512 ones do, one instruction where AVX2 takes two)."""
    flags = cpu_kernels.cpu_extensions()
    level = cpu_kernels.instruction_set()
    if level == "x86-64-v4" and "avx512_vnni" in flags:
        # GFNI (Ice Lake and later, Zen 4): the AVX-512 one-row Q6_K product spreads its
        # high bits with it (kquant_kernels.c's q6_high_bits)
        if "gfni" in flags:
            return "vnni-gfni", ["-mavx512vnni", "-mgfni"]
        return "vnni", ["-mavx512vnni"]
    if level == "x86-64-v3" and "avx_vnni" in flags:
        return "avxvnni", ["-mavxvnni"]
    return None


class QuantizedActivations:
    """Activations [M, K] as signed bytes per block of 32, with each block's scale and
    scale times the sum of its bytes."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, scaled_sum: torch.Tensor) -> None:
        self.q, self.scale, self.scaled_sum = q, scale, scaled_sum


class QuantKernels:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._linear = self.lib.ecq_linear
        self._linear.argtypes, self._linear.restype = _LINEAR_SIGNATURE, ctypes.c_int
        self.path = path

    def linear(
        self, x: torch.Tensor, weight: BlockWeight | KQuantWeight, out: torch.Tensor
    ) -> None:
        """``out`` [M, N] (innermost contiguous) = x W^T for blocks or a Q4_K ``weight``,
        ``x`` float32 [M, K] with its innermost dim contiguous: quantizing the activations
        and the product in one call (the batch-1 decode step makes 120 of these on a
        30-layer model, so the Python side is kept to one foreign call)."""
        if weight.kind not in _LINEAR_KINDS:
            raise ValueError(
                f"ecq_linear does not multiply kind {weight.kind} (a Q5_K / Q6_K part?)"
            )
        qs, d, m = weight.pointers
        failed = self._linear(
            weight.kind, x.data_ptr(), x.stride(0), x.shape[0], weight.shape[0], x.shape[1],
            qs, d, m, out.data_ptr(), out.stride(0),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"no scratch memory for {x.shape[0]} rows of activations")

    def quantize_rows(self, x: torch.Tensor) -> QuantizedActivations:
        """``x`` float32 [M, K], K a multiple of 32, innermost dim contiguous."""
        m, k = x.shape
        q = torch.empty((m, k), dtype=torch.int8)
        scale = torch.empty((m, k // BLOCK), dtype=torch.float32)
        scaled_sum = torch.empty_like(scale)
        self.lib.ecq_quantize_rows(
            x.data_ptr(), x.stride(0), m, k, q.data_ptr(), scale.data_ptr(), scaled_sum.data_ptr()
        )
        return QuantizedActivations(q, scale, scaled_sum)

    def dequantize(
        self,
        bits: int,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float32 weight [N, K] of blocks (``qs``, ``d``, ``m`` as in
        :class:`BlockWeight`), written into ``out`` (contiguous) where given."""
        n, k = d.shape[0], d.shape[1] * BLOCK
        d, m = d.float(), m.float()  # float16 scales of Q4_0 / Q4_1 blocks
        out = result_tensor(out, n, k)
        if bits == 4:
            self.lib.ecq_dequantize_q4(
                n, k, qs.data_ptr(), d.data_ptr(), m.data_ptr(), out.data_ptr()
            )
        else:
            self.lib.ecq_dequantize_q8(n, k, qs.data_ptr(), d.data_ptr(), out.data_ptr())
        return out

    def dequantize_q4_k(
        self, weight: KQuantWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The float32 weight [N, K] of a Q4_K ``weight`` (into ``out`` where given)."""
        n, k = weight.shape
        out = result_tensor(out, n, k)
        self.lib.ecq_dequantize_q4k(
            n, k, weight.qs.data_ptr(), weight.scales.data_ptr(), out.data_ptr()
        )
        return out


def result_tensor(out: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    """``out`` checked to take an [n, k] float32 result, or a new tensor for it."""
    if out is None:
        return torch.empty((n, k), dtype=torch.float32)
    if out.shape != (n, k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"a [{n}, {k}] float32 result given {tuple(out.shape)} {out.dtype}")
    return out


def build(only_path: bool = False) -> Path:
    """Compile the library into the cache (if not there yet); its path (with
    ``only_path``, compiling nothing)."""
    return cpu_kernels.build(
        source=SOURCE, stem="enginecore_quant_kernels", extra_isa=_vnni(), only_path=only_path
    )


library: cpu_kernels.BuildOnce[QuantKernels] = cpu_kernels.BuildOnce(
    lambda: QuantKernels(build()),
    warning="quantized-weight CPU kernels unavailable",
    switch=ENV_SWITCH,
    log=logger,
)


def load() -> QuantKernels | None:
    """The kernels, built on first call; None when switched off or unbuildable (the
    ``gguf`` method then de-quantizes and uses ``F.linear``)."""
    return library()
