"""Products with weights kept in 32-value blocks (the ``gguf`` method's :class:`BlockWeight`
layout), in Triton.

A weight [N, K] is ``qs`` (4 bits: [N, K/32, 16] uint8, byte j of a block holding value j in
its low nibble and value j + 16 in its high one; 8 bits: [N, K] int8) with a scale ``d`` and,
for 4 bits, an offset ``m`` per block ([N, K/32], float16 or float32): value = q d + m.

``block_linear`` computes ``x W^T`` with the blocks de-quantized in registers: one program per
tile of rows and outputs loops over K a tile at a time (a whole number of blocks), widens the
tile's values to float32, applies the scales, and accumulates the tile's product in float32.
The product's operands are the activations' dtype (bf16 / fp16 on tensor cores; fp32 exactly,
not in TF32), so the result is what ``F.linear`` gives on the de-quantized weight in that dtype
up to summation order. The tile shape follows the row count: a decode step's few rows take
narrow tiles (many programs, each a slice of the weight read once); a prefill chunk's many
rows take tiles of 128 rows, so each weight tile de-quantized in registers serves 128 rows
and the weight is never written out. ``dequantize`` writes the weight out in a float dtype
(for references and tools).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on the CPU
through Triton's interpreter, which is how the test suite checks them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["BLOCK", "SUPPORTED_DTYPES", "block_linear", "dequantize", "is_interpreted"]

BLOCK = 32
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Outputs and inputs per program: a decode step's product is a read of the weight, so the
# tiles are kept small enough to give a GPU's multiprocessors a program each on small layers.
_BLOCK_N = 32
_BLOCK_K = 128  # four blocks of 32
# (most rows, BLOCK_M, BLOCK_N, BLOCK_K, warps): the first whose rows hold the product's.
# At least 16 rows (the smallest tl.dot); masked rows cost compute, not weight reads. Past
# 64 rows the product is compute-bound: larger tiles re-use each de-quantized weight tile
# over 128 rows and each activation tile over 64 outputs.
TILES = (
    (16, 16, _BLOCK_N, _BLOCK_K, 4),
    (32, 32, _BLOCK_N, _BLOCK_K, 4),
    (64, 64, _BLOCK_N, _BLOCK_K, 4),
    (None, 128, 64, 64, 8),
)


def tile_for(num_rows: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, warps)`` of a product of ``num_rows`` rows."""
    for most, block_m, block_n, block_k, warps in TILES:
        if most is None or num_rows <= most:
            return block_m, block_n, block_k, warps
    raise AssertionError("the last tile takes any row count")


@triton.jit
def _weight_tile(
    qs_ptr,
    d_ptr,
    m_ptr,
    rn,
    n_mask,
    first_block,
    num_blocks,
    BITS: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
):
    """The float32 values [len(rn), BLOCKS_PER_TILE * 32] of outputs ``rn``, blocks
    ``first_block`` on; blocks past ``num_blocks`` and rows outside ``n_mask`` read as 0."""
    rb = first_block + tl.arange(0, BLOCKS_PER_TILE)
    mask2 = n_mask[:, None] & (rb < num_blocks)[None, :]
    mask3 = mask2[:, :, None]
    row = rn.to(tl.int64)[:, None] * num_blocks + rb[None, :]  # block index [N, B]
    if BITS == 8:
        offsets = row[:, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        q = tl.load(qs_ptr + offsets, mask=mask3, other=0).to(tl.float32)
    else:
        offsets = row[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        byte = tl.load(qs_ptr + offsets, mask=mask3, other=0)
        low = (byte & 0xF).to(tl.float32)
        high = (byte >> 4).to(tl.float32)
        # [N, B, 16, 2] -> [N, B, 2, 16]: the low nibbles are a block's first 16 values.
        q = tl.permute(tl.join(low, high), (0, 1, 3, 2))
        q = tl.reshape(q, (rn.shape[0], BLOCKS_PER_TILE, 32))
    d = tl.load(d_ptr + row, mask=mask2, other=0.0).to(tl.float32)
    w = q * d[:, :, None]
    if BITS == 4:
        m = tl.load(m_ptr + row, mask=mask2, other=0.0).to(tl.float32)
        w = w + m[:, :, None]
    return tl.reshape(w, (rn.shape[0], BLOCKS_PER_TILE * 32))


@triton.jit
def _block_linear_kernel(
    x_ptr,
    qs_ptr,
    d_ptr,
    m_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    num_blocks = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None] & (rk < K)[None, :], other=0.0)
        w = _weight_tile(
            qs_ptr, d_ptr, m_ptr, rn, n_mask, k0 // 32, num_blocks, BITS, BLOCK_K // 32
        )
        if DOT_IN_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_kernel(
    qs_ptr,
    d_ptr,
    m_ptr,
    out_ptr,
    N,
    K,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w = _weight_tile(qs_ptr, d_ptr, m_ptr, rn, n_mask, k0 // 32, K // 32, BITS, BLOCK_K // 32)
    out = out_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (rk < K)[None, :])


def is_interpreted() -> bool:
    """True when the kernels run on Triton's CPU interpreter (``TRITON_INTERPRET=1`` at
    import)."""
    return isinstance(_block_linear_kernel, InterpretedFunction)


def block_linear(
    x: Tensor, bits: int, qs: Tensor, d: Tensor, m: Tensor, out: Tensor | None = None
) -> Tensor:
    """``x`` [M, K] times the transposed block weight [N, K]: [M, N] in ``x``'s dtype, written
    into ``out`` (any [M, N] view whose last dimension is contiguous) when given."""
    _check_weight(bits, qs, d, m)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"activations in {x.dtype}: supported are {SUPPORTED_DTYPES}")
    num_rows, k = x.shape
    n = d.shape[0]
    if k != d.shape[1] * BLOCK:
        raise ValueError(f"activations have {k} inputs, the weight {d.shape[1] * BLOCK}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be a [{num_rows}, {n}] view with contiguous rows")
    if num_rows == 0:
        return out
    block_m, block_n, block_k, warps = tile_for(num_rows)
    # Triton's interpreter multiplies bf16 operands of tl.dot as their raw bit patterns, so
    # there the tiles are widened first (bf16 products are exact in float32).
    in_fp32 = x.dtype == torch.float32 or (is_interpreted() and x.dtype == torch.bfloat16)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))
    with _on_device(x.device):
        _block_linear_kernel[grid](
            x,
            qs,
            d,
            m,
            out,
            num_rows,
            n,
            k,
            x.stride(0),
            out.stride(0),
            BITS=bits,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            DOT_IN_FP32=in_fp32,
            # fp32 activations get exact fp32 products (tl.dot would otherwise use TF32).
            DOT_PRECISION="ieee" if in_fp32 else "tf32",
            num_warps=warps,
        )
    return out


def dequantize(bits: int, qs: Tensor, d: Tensor, m: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight [N, K] the blocks stand for, in ``dtype``, on their device."""
    _check_weight(bits, qs, d, m)
    n, k = d.shape[0], d.shape[1] * BLOCK
    out = torch.empty((n, k), dtype=dtype, device=qs.device)
    if n:
        grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K))
        with _on_device(qs.device):
            _dequantize_kernel[grid](
                qs, d, m, out, n, k, BITS=bits, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K
            )
    return out


def _check_weight(bits: int, qs: Tensor, d: Tensor, m: Tensor) -> None:
    if bits not in (4, 8):
        raise ValueError(f"blocks of {bits} bits: supported are 4 and 8")
    n, num_blocks = d.shape
    want = (n, num_blocks, BLOCK // 2) if bits == 4 else (n, num_blocks * BLOCK)
    if tuple(qs.shape) != want:
        raise ValueError(f"{bits}-bit values of shape {tuple(qs.shape)}, expected {want}")
    if bits == 4 and m.shape != d.shape:
        raise ValueError(f"offsets of shape {tuple(m.shape)}, expected {tuple(d.shape)}")
    if not (qs.is_contiguous() and d.is_contiguous() and m.is_contiguous()):
        raise ValueError("block weights must be contiguous")


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()
