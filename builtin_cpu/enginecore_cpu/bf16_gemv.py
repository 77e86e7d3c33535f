"""Loader of ``bf16_gemv.c``: bfloat16 weights times a few bfloat16 activation rows with
float32 sums (AVX512-BF16's ``vdpbf16ps``), for the decode steps of a bfloat16 model.

Built only where the CPU has ``avx512_bf16`` (the file name says so); elsewhere, with no
compiler, or with ``ENGINECORE_BF16_GEMV=0``, :func:`load` gives None and the
``cpu_packed`` method keeps its other paths. oneDNN's bfloat16 GEMM (AMX where the CPU
has it) is faster from :data:`KERNEL_MAX_ROWS` rows up and slower below.
"""

from __future__ import annotations

import ctypes
import logging
from ctypes import c_int, c_int64, c_void_p
from pathlib import Path

import torch

from enginecore_cpu import cpu_kernels

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_gemv.c")
ENV_SWITCH = "ENGINECORE_BF16_GEMV"
# Activation rows up to which the kernel beats torch's bfloat16 F.linear (AMX) on the
# demo model's projections and LM head (benchmarks/bf16_gemv.py; docs/quantization.md).
KERNEL_MAX_ROWS = 8

_P, _I64 = c_void_p, c_int64
_SIGNATURE = (_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, c_int)


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU has AVX512-BF16's bfloat16 dot products (``vdpbf16ps``)."""
    flags = cpu_kernels.cpu_extensions()
    return cpu_kernels.instruction_set() == "x86-64-v4" and "avx512_bf16" in flags


class Bf16Gemv:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self._linear = self.lib.ecb_linear
        self._linear.argtypes, self._linear.restype = _SIGNATURE, None
        self.path = path

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x W^T + b`` in bfloat16, ``x`` [..., K], ``weight`` [N, K] with K contiguous,
        ``bias`` [N] or None."""
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or weight.stride(1) != 1:
            raise ValueError(f"bf16_gemv needs a bfloat16 weight with K contiguous, got "
                             f"{weight.dtype} strides {weight.stride()}")  # fmt: skip
        if x.dtype != torch.bfloat16 or x.shape[-1] != k:
            raise ValueError(f"bf16_gemv: activations {x.dtype} {tuple(x.shape)} for a "
                             f"bfloat16 weight {tuple(weight.shape)}")  # fmt: skip
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        out = torch.empty((rows.shape[0], n), dtype=torch.bfloat16)
        self._linear(
            rows.data_ptr(), rows.stride(0), rows.shape[0], n, k,
            weight.data_ptr(), weight.stride(0), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        return out.view(*x.shape[:-1], n)


def build(only_path: bool = False) -> Path:
    """Compile the library into the cache (if not there yet); its path (with
    ``only_path``, compiling nothing)."""
    return cpu_kernels.build(
        source=SOURCE,
        stem="enginecore_bf16_gemv",
        extra_isa=("bf16", ["-mavx512bf16"]),
        only_path=only_path,
    )


library: cpu_kernels.BuildOnce[Bf16Gemv] = cpu_kernels.BuildOnce(
    lambda: Bf16Gemv(build()),
    warning="bfloat16 CPU kernel unavailable",
    switch=ENV_SWITCH,
    log=logger,
    available=lambda: cpu_has_avx512_bf16(),  # looked up per call: tests replace it
    target=lambda: build(only_path=True),
    build=build,
)


def load() -> Bf16Gemv | None:
    """The kernel, built on first call; None without AVX512-BF16, when switched off or
    when it cannot be built (logged once)."""
    return library()
