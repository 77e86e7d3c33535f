"""Attention with soft-capped scores (Gemma 2): ``cap * tanh(scores / cap)`` before the
mask and softmax. SDPA cannot apply it, so the scores are computed here and the softmax
runs in float32, as the reference does."""

from __future__ import annotations

import torch


def soft_capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    cap: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q [..., H_q, L, D], k/v [..., H_kv, S, D] (H_q a multiple of H_kv); ``mask`` is
    boolean (True: attend) or additive; ``causal`` aligns the last query with the last
    key. Returns [..., H_q, L, D]."""
    if k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
