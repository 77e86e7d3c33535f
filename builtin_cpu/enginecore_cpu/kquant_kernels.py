"""Loader of ``kquant_kernels.c``: products over GGUF's Q5_K and Q6_K weights as the
``gguf`` linear method keeps them (:class:`~enginecore.block_formats.kquant_blocks.KQuantWeight`),
built as ``quant_kernels`` is and taking its quantized activations."""

from __future__ import annotations

import ctypes
import logging
from ctypes import c_int64, c_void_p
from pathlib import Path

import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.layers.quantized import QuantizedTensor
from enginecore_cpu import cpu_kernels, quant_kernels
from enginecore_cpu.quant_kernels import QuantizedActivations

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kquant_kernels.c")

_P, _I64 = c_void_p, c_int64
_SIGNATURES = {
    "eck_gemm_k": [_I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64],
    "eck_dequantize_k": [_I64, _I64, _I64, _P, _P, _P],
    "eck_repack_k": [_I64, _I64, _I64, _P, _I64, _P, _P, _P],
    "eck_repack_blocks": [_I64, _I64, _I64, _P, _I64, _P, _P, _P, _P],
    "eck_q5_packed": [],
    "eck_q6_packed": [],
}
_RETURNS = {"eck_repack_blocks": c_int64, "eck_q5_packed": c_int64, "eck_q6_packed": c_int64}
# eck_repack_blocks' names of the 32-value formats
_BLOCK_KINDS = {"Q8_0": 8, "Q4_0": 40, "Q4_1": 41}


class KQuantKernels:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, _RETURNS.get(name)
        self.path = path
        # the layouts of Q5_K's and Q6_K's high bits this build reads and writes
        # (quant_simd.h), looked up at each product's check
        self._high = {
            "Q5_K": _layout(self.lib.eck_q5_packed()),
            "Q6_K": _layout(self.lib.eck_q6_packed()),
        }

    def high(self, fmt: str) -> str:
        """The layout of a ``fmt`` weight's high bits that these kernels take."""
        return self._high.get(fmt, kquant_blocks.PLANES)

    def from_gguf(self, data: torch.Tensor, fmt: str, shape: tuple[int, int]) -> KQuantWeight:
        """``kquant_blocks.from_gguf`` in the layout these kernels take (in torch)."""
        return kquant_blocks.from_gguf(data, fmt, shape, self.high(fmt))

    def _check(self, weight: KQuantWeight) -> None:
        if weight.high != self.high(weight.fmt):
            raise ValueError(
                f"a {weight.fmt} weight with {weight.high} high bits, for kernels that read "
                f"{self.high(weight.fmt)}"
            )

    def gemm_k(self, acts: QuantizedActivations, weight: KQuantWeight, out: torch.Tensor) -> None:
        """``out`` [M, N] (innermost contiguous) = x W^T for a Q5_K or Q6_K ``weight``
        [N, K]."""
        self._check(weight)
        rows, k = acts.q.shape
        self.lib.eck_gemm_k(
            rows, weight.shape[0], k, weight.bits, weight.qs.data_ptr(),
            weight.scales.data_ptr(), acts.q.data_ptr(), acts.scale.data_ptr(),
            acts.scaled_sum.data_ptr(), out.data_ptr(), out.stride(0),
        )  # fmt: skip

    def dequantize_k(self, weight: KQuantWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [N, K] of a Q5_K or Q6_K ``weight`` (into ``out`` where given):
        in torch, the same floats, where its high bits are in the other layout."""
        n, k = weight.shape
        out = quant_kernels.result_tensor(out, n, k)
        if weight.high != self.high(weight.fmt):
            return out.copy_(kquant_blocks.dequantize(weight))
        self.lib.eck_dequantize_k(
            n, k, weight.bits, weight.qs.data_ptr(), weight.scales.data_ptr(), out.data_ptr()
        )
        return out

    def unpacked(
        self, tensors: list[QuantizedTensor], into: KQuantWeight | None = None
    ) -> KQuantWeight:
        """GGUF's K-quant ``tensors`` (one format and width, row ranges in order) as one
        :class:`KQuantWeight` of all their rows (written into ``into`` where given: an
        entry of the prepared-weight cache): the bytes of ``kquant_blocks.from_gguf`` of
        their concatenation (Q5_K's and Q6_K's high bits in this build's layout), written
        once, on every thread, straight from the file's blocks (no copy of a piece, and
        none to join them)."""
        fmt, k = tensors[0].format, tensors[0].shape[1]
        if any(t.format != fmt or t.shape[1] != k for t in tensors):
            raise ValueError("the pieces of one K-quant weight share its format and width")
        if fmt not in kquant_blocks.FORMATS or k % kquant_blocks.SUPER:
            # the reference names what is wrong
            return self.from_gguf(tensors[0].data, fmt, tensors[0].shape)
        rows = sum(t.shape[0] for t in tensors)
        empty = into or kquant_blocks.empty_weight(fmt, (rows, k), high=self.high(fmt))
        if (empty.fmt, empty.shape, empty.high) != (fmt, (rows, k), self.high(fmt)):
            raise ValueError(
                f"{fmt} rows {rows}x{k} given a {empty.fmt} {empty.shape} weight "
                f"with {empty.high} high bits"
            )
        at = 0
        for tensor in tensors:
            (data, order), n = _rows(tensor), tensor.shape[0]
            if not n:
                continue
            self.lib.eck_repack_k(
                empty.bits, n, k, data.data_ptr(), data.stride(0), _address(order),
                empty.qs[at].data_ptr(), empty.scales[at].data_ptr(),
            )  # fmt: skip
            at += n
        return empty

    def blocks_into(self, tensors: list[QuantizedTensor], into: BlockWeight) -> bool:
        """GGUF's Q8_0 / Q4_0 / Q4_1 ``tensors`` (one format and width, row ranges in
        order) written into ``into`` (:func:`gguf_blocks.empty_blocks` of all their rows):
        the bytes of ``gguf_blocks.from_gguf`` of their concatenation. False where a
        Q4_0 offset -8 d leaves float16's range (``from_gguf`` keeps float32 scales then)."""
        fmt, k = tensors[0].format, tensors[0].shape[1]
        rows = sum(t.shape[0] for t in tensors)
        if any(t.format != fmt or t.shape[1] != k for t in tensors) or into.shape != (rows, k):
            raise ValueError(f"{fmt} rows {rows}x{k} do not fit a {into.shape} weight")
        if fmt not in _BLOCK_KINDS or k % gguf_blocks.BLOCK:
            raise ValueError(f"{fmt} rows of {k} values are not GGUF 32-value blocks")
        at, ok = 0, True
        for tensor in tensors:
            (data, order), n = _rows(tensor), tensor.shape[0]
            if n:
                ok = ok and not self.lib.eck_repack_blocks(
                    _BLOCK_KINDS[fmt], n, k, data.data_ptr(), data.stride(0), _address(order),
                    into.qs[at].data_ptr(), into.d[at].data_ptr(), into.m[at].data_ptr(),
                )  # fmt: skip
            at += n
        return ok


def _rows(tensor: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tensor``'s bytes as rows the C functions read (a row's bytes contiguous), and
    the order to read them in (:meth:`QuantizedTensor.stored_rows`)."""
    data, order = tensor.stored_rows()
    if data.dtype != torch.uint8 or data.dim() != 2 or data.stride(1) != 1:
        data = data.reshape(data.shape[0], -1).to(torch.uint8).contiguous()
    if order is not None:
        order = order.to(torch.int64).contiguous()
        if order.shape != (tensor.shape[0],) or not bool(
            ((order >= 0) & (order < len(data))).all()
        ):
            raise ValueError(f"a row order of {tuple(order.shape)} for {tensor.shape[0]} rows")
    return data, order


def _address(order: torch.Tensor | None) -> int | None:
    return None if order is None else order.data_ptr()


def _layout(packed: int) -> str:
    return kquant_blocks.PACKED if packed else kquant_blocks.PLANES


def q5_high() -> str:
    """The layout of Q5_K's 5th bits this CPU's build takes, known without building it:
    eight values a byte on x86-64-v3 (AVX2 without AVX-512's byte masks), bit planes on
    every other level (quant_simd.h's Q5K_PACKED)."""
    return _layout(cpu_kernels.instruction_set() == "x86-64-v3")


def q6_high() -> str:
    """The layout of Q6_K's high bits this CPU's build takes, known without building it:
    two bits a value on x86-64-v3 (AVX2 without AVX-512's byte masks), bit planes on
    every other level (quant_simd.h's Q6K_PACKED)."""
    return _layout(cpu_kernels.instruction_set() == "x86-64-v3")


def build(only_path: bool = False) -> Path:
    """Compile the library into the cache (if not there yet); its path (with
    ``only_path``, compiling nothing)."""
    return cpu_kernels.build(
        source=SOURCE,
        stem="enginecore_kquant_kernels",
        extra_isa=quant_kernels._vnni(),
        only_path=only_path,
    )


library: cpu_kernels.BuildOnce[KQuantKernels] = cpu_kernels.BuildOnce(
    lambda: KQuantKernels(build()),
    warning="K-quant CPU kernels unavailable",
    switch=quant_kernels.ENV_SWITCH,
    log=logger,
)


def load() -> KQuantKernels | None:
    """The kernels, built on first call; None when switched off (the switch of
    ``quant_kernels``) or unbuildable."""
    return library()
