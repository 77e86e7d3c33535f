"""LoRA shrink and expand in Triton, for the ``triton`` attention backend.

One kernel serves both (punica's batched GEMV, "bgmv"): each program takes one token
row that has an adapter and a tile of output columns, reads the row's slot, and
multiplies the row by that slot's stacked weight. Shrink writes ``x @ A[slot]^T`` into a
float32 buffer; expand adds ``buf @ B[slot]^T`` into the projection's output. Only the
rows with an adapter (``mapping.sorted_rows``) get programs, so the base model's tokens
in a mixed batch cost nothing. Under ``TRITON_INTERPRET=1`` the kernel runs on the CPU
through Triton's interpreter, which is how the tests check it against the torch kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from enginecore.interfaces import LoRAKernels
from enginecore.lora.mapping import LoRABatchMapping


@triton.jit
def _bgmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    slots_ptr,
    n_cols,
    k_dim,
    stride_xm,
    stride_ws,
    stride_wn,
    stride_om,
    ADD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.load(rows_ptr + tl.program_id(0))
    slot = tl.load(slots_ptr + row)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, k_dim, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_dim
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    out = out_ptr + row * stride_om + offs_n
    if ADD:
        acc += tl.load(out, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _bgmv(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, mapping: LoRABatchMapping, add: bool
) -> None:
    rows = mapping.sorted_rows
    if rows.numel() == 0:
        return
    x = x.contiguous()
    if w.stride(2) != 1:  # the kernel walks k contiguously; slot and row strides are free
        w = w.contiguous()
    n_cols, k_dim = w.shape[1], w.shape[2]
    block_n = min(64, triton.next_power_of_2(n_cols))
    block_k = min(128, triton.next_power_of_2(k_dim))
    grid = (rows.numel(), triton.cdiv(n_cols, block_n))
    _bgmv_kernel[grid](
        x,
        w,
        out,
        rows,
        mapping.token_slots,
        n_cols,
        k_dim,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ADD=add,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


class TritonLoRAKernels(LoRAKernels):
    name = "triton"

    def shrink(
        self, x: torch.Tensor, a_stack: torch.Tensor, mapping: LoRABatchMapping
    ) -> torch.Tensor:
        buf = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
        _bgmv(x, a_stack, buf, mapping, add=False)
        return buf

    def expand(
        self,
        y: torch.Tensor,
        buf: torch.Tensor,
        b_stack: torch.Tensor,
        mapping: LoRABatchMapping,
    ) -> None:
        if y.stride(-1) != 1:
            raise ValueError("the projection output must be contiguous in its last dimension")
        _bgmv(buf, b_stack, y, mapping, add=True)
