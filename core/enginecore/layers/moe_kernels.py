"""The Triton grouped GEMM of the MoE experts' device path (``enginecore.layers.moe_grouped``).

``grouped_linear`` multiplies tiles of (token, k) pairs, each tile one expert's, by that
expert's weight: one program per (tile, output tile), an idle tile (expert -1) returning at
once. A program reads the activation rows of its pairs where they lie (row ``pair //
ROW_DIV``) and writes each pair's output row, so no gathered copy is made. Under
``TRITON_INTERPRET=1`` (set before this module is imported) it runs on the CPU through
Triton's interpreter, which is how the tests check it.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

_BLOCK_N = 64
_BLOCK_K = 64


@triton.jit
def _grouped_linear_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    tile_experts_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    ROW_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    a_rows = a_ptr + (pair // ROW_DIV).to(tl.int64)[:, None] * stride_am
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        a = tl.load(a_rows + rk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision=DOT_PRECISION)  # fmt: skip
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def is_interpreted() -> bool:
    """True when the kernel runs on Triton's CPU interpreter."""
    return isinstance(_grouped_linear_kernel, InterpretedFunction)


def grouped_linear(
    a: Tensor,
    weights: Tensor,
    pairs: Tensor,
    tile_experts: Tensor,
    num_pairs: int,
    row_div: int,
    block_m: int,
) -> Tensor:
    """``out[p] = a[p // row_div] @ weights[expert of p].T`` for every pair ``p`` in
    ``pairs``: [num_pairs, N] in ``a``'s dtype (``weights`` [E, N, K])."""
    _, n, k = weights.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    # The interpreter multiplies bf16 operands of tl.dot as raw bit patterns: widen there.
    in_fp32 = a.dtype == torch.float32 or (is_interpreted() and a.dtype == torch.bfloat16)
    grid = (tile_experts.numel(), triton.cdiv(n, _BLOCK_N))
    with _on_device(a.device):
        _grouped_linear_kernel[grid](
            a,
            weights,
            out,
            pairs,
            tile_experts,
            num_pairs,
            n,
            k,
            a.stride(0),
            weights.stride(0),
            weights.stride(1),
            out.stride(0),
            ROW_DIV=row_div,
            BLOCK_M=block_m,
            BLOCK_N=_BLOCK_N,
            BLOCK_K=_BLOCK_K,
            DOT_IN_FP32=in_fp32,
            DOT_PRECISION="ieee" if in_fp32 else "tf32",
        )
    return out


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()
