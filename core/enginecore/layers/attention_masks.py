"""Attention masks for the torch paths: causal, and narrowed to a sliding window.

Convention (transformers' ``sliding_window_overlay``): a query at absolute position ``q``
sees key ``k`` iff ``q - window < k <= q``, i.e. the last ``window`` positions including
its own.

The window is a mask over the gathered keys. Where sliding layers keep only their window
in the KV cache, the block-table entries before it are stale or block 0: the mask is
what keeps them out.
"""

from __future__ import annotations

import torch


def restrict_to_window(mask: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [R, 1, Q, K] (True = attend) narrowed to keys ``k > q_pos - window``.

    ``q_pos`` is [R, Q], the absolute position of each query row. A padded query row
    whose keys all fall outside keeps key 0 (SDPA gives NaN for a fully masked row; the
    padded rows' outputs are dropped anyway)."""
    k_idx = torch.arange(mask.shape[-1], device=mask.device)
    inside = k_idx[None, None, :] > (q_pos[:, :, None] - window)  # [R, Q, K]
    windowed = mask & inside.unsqueeze(1)
    empty = ~windowed.any(dim=-1, keepdim=True)
    return windowed | (empty & (k_idx == 0))


def decode_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """[R, 1, 1, kv_len] bool, True = attend, for one query per row at ``q_pos`` [R, 1]:
    keys up to its own position, the last ``window`` of them when given."""
    k_idx = torch.arange(kv_len, device=q_pos.device)
    mask = (k_idx[None, :] <= q_pos)[:, None, None, :]
    return mask if window is None else restrict_to_window(mask, q_pos, window)
