"""The MoE experts' device path: tokens grouped by expert without the host, so a step
never waits on the device and can be captured in a CUDA graph.

Every shape here depends on the step's token count only, never on the routing:

1. ``align_by_expert`` groups the step's (token, k) pairs by expert on the device (each
   pair's rank among its expert's from a running count, no sort) and lays them out in
   tiles of ``block_m`` rows, each tile holding one expert's pairs (an
   expert's last tile padded with a sentinel pair). The buffer has room for the worst case
   (every expert with a part-filled tile), so its size is fixed; tiles past the last used
   one carry expert -1.
2. ``grouped_linear`` (``enginecore.layers.moe_kernels``, a Triton kernel) multiplies each
   tile by its expert's weight, reading the activation rows of its pairs where they lie
   (token ``pair // top_k`` for the first GEMM, the pair's own row for the second) and
   writing each pair's row, so no gathered copy of the activations is made.

The routing weights are applied and the top-k results summed in a fixed-shape reduction.
Under ``TRITON_INTERPRET=1`` (set before the kernel's module is imported) the kernel runs on
the CPU through Triton's interpreter, which is how the tests check it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def tile_rows(num_pairs: int) -> int:
    """Rows a tile holds: small tiles waste little on experts with few pairs (decode),
    larger ones reuse each weight tile over more rows (prefill)."""
    return 16 if num_pairs <= 1024 else 64


def align_by_expert(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """``(pairs, tile_experts)``: the flat (token, k) pair indices of ``ids`` [T, top_k]
    grouped by expert in tiles of ``block_m`` (empty slots hold ``T * top_k``), and each
    tile's expert (-1 for tiles past the last used one). Fixed shapes, no host sync."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    capacity = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    # A pair's rank among its expert's pairs, in pair order, from a running count per
    # expert: no sort, no value-dependent shape.
    hits = flat[:, None] == torch.arange(num_experts, device=flat.device)
    counts = hits.sum(0)
    rank = hits.cumsum(0, dtype=torch.int32).gather(1, flat[:, None]).squeeze(1) - 1
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    dest = (padded_end - padded).index_select(0, flat) + rank
    pairs = torch.full((capacity,), n, dtype=torch.int64, device=flat.device)
    pairs.scatter_(0, dest, torch.arange(n, device=flat.device))
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return pairs, tile_experts


def grouped_experts(
    x: Tensor,
    topk_weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    num_experts: int,
    activation: Any,
) -> Tensor:
    """``sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])`` for x [T, H], with no host
    sync and shapes fixed by T: what a CUDA graph can capture."""
    from enginecore.layers.activation import act_and_mul
    from enginecore.layers.moe_kernels import grouped_linear

    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = tile_rows(num_pairs)
    pairs, tile_experts = align_by_expert(ids, num_experts, block_m)
    gate_up = grouped_linear(x, w13, pairs, tile_experts, num_pairs, top_k, block_m)
    hidden = act_and_mul(activation, gate_up)
    down = grouped_linear(hidden, w2, pairs, tile_experts, num_pairs, 1, block_m)
    weighted = down.view(tokens, top_k, -1).float() * topk_weights.float()[..., None]
    return weighted.sum(1).to(x.dtype)
