"""CPU projections through MKL's packed GEMM: pack a weight once, multiply it many times.

``F.linear`` hands MKL the plain weight, and sgemm copies it into its internal panel
layout on every call. With the small K of these models (256-768) and the 2-300 rows of a
decode step, that copy is a large share of the call. MKL's ``cblas_sgemm_pack`` does it
once at load time and ``cblas_sgemm_compute`` reuses the packed copy: 1.02-1.8x faster
than input-major ``F.linear`` (AVX-512, float32) for outputs of 512 or more features at
16-300 rows. Narrower outputs (256 features) run up to 1.7x slower, and at 2,048 rows
packing gains nothing (0.94-1.0x on most shapes): those keep ``F.linear``.

A packed weight is used only where it gives the same bits as ``F.linear``, so greedy
outputs stay those of the unpacked model:
- each weight shape is probed, with and without a bias, and left unpacked if any output
  differs (packed, MKL split K=1024 and 2048 differently, which changes the summation
  order). The summation order depends on the shape, MKL and the CPU, not on the values,
  so a verdict is kept on disk (``probe_cache``) and later starts skip the probe, which
  took most of a small model's start-up;
- a single row keeps ``F.linear``: MKL takes its matrix-vector path there;
- row-major weights (a head tied to the embedding) are not packed: their packed
  product differed from ``F.linear``'s.

The packed copy is a snapshot: ``project`` uses it only while the weight still has the
storage and version it was packed from, and the model runner packs again whenever it
loads weights. It costs the packed weights' size again in memory; the runner packs only
when that is at most a quarter of what is free. Needs torch built with MKL (the x86
wheels); elsewhere, or with ``ENGINECORE_PACKED_GEMM=0``, projections use ``F.linear``.

On a CPU with AVX2 and no AVX-512, ``pack_weights`` hands the weights to enginecore's own
GEMM instead (``panel_gemm``). There it was much faster than MKL at decode sizes and on
the LM head, and about as fast on the other projections at 256 rows.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from ctypes import c_float, c_int, c_size_t, c_void_p
from pathlib import Path

import torch
import torch.nn.functional as F

from enginecore import startup_log
from enginecore_cpu import panel_gemm, probe_cache
from enginecore_cpu.cpu_kernels import load as load_cpu_kernels
from enginecore_cpu.cpu_kernels import switched_off

logger = logging.getLogger(__name__)

ENV_SWITCH = "ENGINECORE_PACKED_GEMM"
MIN_OUT_FEATURES = 512
# The row count MKL packs for. Measured: packing for 256 rows is fastest at 16-300 rows
# and as fast as F.linear at 2,048; packing for 1 or 2,048 rows lost at decode sizes.
PACK_ROWS = 256
MAX_ROWS = 512  # more rows: F.linear (see above)
PROBE_ROWS = (2, 37, 300)
# Wider weights are packed as blocks of this many output columns, one GEMM each: MKL runs
# an 8,192-wide LM head at 256 rows 13% faster in 2,048-wide blocks (1,024: 12%), with
# the same bits.
MAX_BLOCK_COLUMNS = 2048

# CBLAS enums (mkl_cblas.h); MKL_INT is 32-bit in the LP64 interface torch links.
_ROW_MAJOR, _NO_TRANS, _PACKED, _B_MATRIX = 101, 111, 151, 162
_ATTR = "_packed_gemm"


class _Mkl:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.get_size = lib.cblas_sgemm_pack_get_size
        self.get_size.restype = c_size_t
        self.get_size.argtypes = [c_int, c_int, c_int, c_int]
        self.pack = lib.cblas_sgemm_pack
        self.pack.restype = None
        self.pack.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_float]
        self.pack.argtypes += [c_void_p, c_int, c_void_p]
        self.compute = lib.cblas_sgemm_compute
        self.compute.restype = None
        self.compute.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_void_p, c_int]
        self.compute.argtypes += [c_void_p, c_int, c_float, c_void_p, c_int]


@functools.cache
def mkl() -> _Mkl | None:
    """MKL's packed-GEMM entry points from torch's own library, or None."""
    if switched_off(ENV_SWITCH) or not torch.backends.mkl.is_available():
        return None
    try:
        return _Mkl(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")))
    except (OSError, AttributeError) as exc:
        logger.info("MKL packed GEMM not available: %s", exc)
        return None


class PackedWeight:
    """One input-major projection weight (logical [out, in], stored [in, out]; see
    ``use_input_major_weights``) in MKL's packed layout, as column blocks of at most
    ``MAX_BLOCK_COLUMNS`` outputs."""

    def __init__(self, lib: _Mkl, weight: torch.Tensor) -> None:
        self.lib = lib
        self.n, self.k = weight.shape
        self.blocks: list[tuple[int, int, torch.Tensor]] = []  # (first column, width, buffer)
        for first in range(0, self.n, MAX_BLOCK_COLUMNS):
            width = min(MAX_BLOCK_COLUMNS, self.n - first)
            size = lib.get_size(_B_MATRIX, PACK_ROWS, width, self.k)
            # MKL wants packed buffers 64-byte aligned, which torch's CPU allocator gives.
            buffer = torch.empty(-(-size // 4), dtype=torch.float32)
            src = weight.data_ptr() + first * weight.element_size()  # [in, out]: columns
            lib.pack(
                _ROW_MAJOR, _B_MATRIX, _NO_TRANS, PACK_ROWS, width, self.k, 1.0, src, self.n,
                buffer.data_ptr(),
            )  # fmt: skip
            self.blocks.append((first, width, buffer))
        self.source = (weight.data_ptr(), weight._version)

    def accepts(self, rows: int) -> bool:
        """A single row keeps ``F.linear``: MKL takes its matrix-vector path there, which
        sums in another order than any GEMM."""
        return 1 < rows <= MAX_ROWS

    def current_for(self, weight: torch.Tensor) -> bool:
        return self.source == (weight.data_ptr(), weight._version)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x`` of shape [..., in]."""
        n, k = self.n, self.k
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1 or rows.stride(0) < k:
            rows = rows.contiguous()
        m = rows.shape[0]
        # With a bias, as torch's addmm: the output starts as the bias and the GEMM adds
        # to it (beta 1); adding the bias afterwards can round differently from F.linear.
        if bias is None:
            out, beta = torch.empty((m, n), dtype=torch.float32), 0.0
        else:
            out, beta = bias.expand(m, n).contiguous(), 1.0
        if m:
            a, c, size = rows.data_ptr(), out.data_ptr(), out.element_size()
            for first, width, buffer in self.blocks:  # each block writes its columns of out
                self.lib.compute(
                    _ROW_MAJOR, _NO_TRANS, _PACKED, m, width, k, a, rows.stride(0),
                    buffer.data_ptr(), width, beta, c + first * size, n,
                )  # fmt: skip
        return out.view(*x.shape[:-1], n)


Packed = PackedWeight | panel_gemm.PanelWeight


def packed_for(weight: torch.Tensor, x: torch.Tensor) -> Packed | None:
    """The weight's packed copy, if it has one that is still current and takes ``x``'s
    row count."""
    packed = getattr(weight, _ATTR, None)
    if packed is None or not packed.accepts(x.numel() // x.shape[-1]):
        return None
    return packed if packed.current_for(weight) else None


def _same_bits(packed: PackedWeight, weight: torch.Tensor) -> bool:
    """Probed with and without a bias: whether a layer has one is not known here."""
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(packed.n, generator=gen)
    for rows in PROBE_ROWS:
        x = torch.randn(rows, packed.k, generator=gen)
        if not torch.equal(packed.linear(x), F.linear(x, weight)):
            return False
        if not torch.equal(packed.linear(x, bias), F.linear(x, weight, bias)):
            return False
    return True


def eligible(weight: torch.Tensor) -> bool:
    """A float32 CPU weight, input-major (row-major ones, such as a head tied to the
    embedding, gave other bits packed than ``F.linear``), with enough outputs to gain."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[0] >= MIN_OUT_FEATURES
        and weight.stride() == (1, weight.shape[0])
    )


def backend() -> str | None:
    """What ``pack_weights`` packs for on this machine, or None (``F.linear`` only)."""
    if panel_gemm.preferred():
        return "enginecore's AVX2 GEMM"
    return "MKL's packed GEMM" if mkl() is not None else None


def pack_weights(weights: list[torch.Tensor]) -> int:
    """Pack every eligible weight for this machine's backend; returns how many. For MKL,
    only weights that give the same bits packed. Packing again replaces an earlier copy;
    a weight that no longer qualifies loses it."""
    if panel_gemm.preferred():
        kernels = load_cpu_kernels()
        assert kernels is not None  # preferred() means they loaded
        for weight in weights:
            panel: panel_gemm.PanelWeight | None = None
            if panel_gemm.eligible(weight):
                half = panel_gemm.gated_half(weight)
                panel = panel_gemm.PanelWeight(kernels, weight, half)
            setattr(weight, _ATTR, panel)
        return sum(getattr(weight, _ATTR) is not None for weight in weights)
    lib = mkl()
    count = 0
    for weight in weights:
        setattr(weight, _ATTR, None)
        if lib is None or not eligible(weight):
            continue
        packed = PackedWeight(lib, weight)
        shape = tuple(weight.shape)
        verdict = probe_cache.lookup(shape)
        if verdict is None:
            startup_log.logger.info("probing MKL's packed GEMM on a %s weight (once)", shape)
            verdict = _same_bits(packed, weight)
            probe_cache.record(shape, verdict)
        if verdict:
            setattr(weight, _ATTR, packed)
            count += 1
        else:
            logger.debug(
                "weight %s not packed: the packed GEMM sums in another order", tuple(weight.shape)
            )
    return count


def packed_bytes(weights: list[torch.Tensor]) -> int:
    """What packing the eligible ones would add to memory (about their own size)."""
    fits = panel_gemm.eligible if panel_gemm.preferred() else eligible
    return sum(w.numel() * w.element_size() for w in weights if fits(w))
