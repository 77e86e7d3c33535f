"""Driving an attention backend (or a whole model) step by step, outside the engine.

What the model runner does each step, in a few lines a test can call: lay out a batch
(:func:`make_batch`), let the backend build its metadata, and hand layers the context
(:func:`step_context`). Also the float64 oracle the contracts compare against
(:func:`reference_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from enginecore.interfaces import AttentionBackend, AttentionSpec
from enginecore.layers.attention import AttentionBatch, AttentionContext


def make_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    req_ids: Sequence[str] | None = None,
) -> AttentionBatch:
    """The runner's layout of one step: request ``r`` has ``context_lens[r]`` tokens in
    the cache and ``query_lens[r]`` new ones, stored through ``block_tables[r]``. Decodes
    (one query token) must come first, as the runner orders them."""
    q = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    num_decodes = 0
    while num_decodes < len(q) and q[num_decodes] == 1:
        num_decodes += 1
    if (q[num_decodes:] == 1).any():
        raise ValueError("single-token queries (decodes) must come first in a batch")
    width = max((len(t) for t in block_tables), default=1) or 1
    table = np.zeros((len(q), width), dtype=np.int64)
    for r, blocks in enumerate(block_tables):
        table[r, : len(blocks)] = blocks
    req_of_token = np.repeat(np.arange(len(q)), q)
    offsets = np.cumsum(q) - q
    positions = np.arange(int(q.sum())) - offsets[req_of_token] + ctx[req_of_token]
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    ids = list(req_ids) if req_ids is not None else [f"r{i}" for i in range(len(q))]
    return AttentionBatch(ids, q, ctx, table, slots, num_decodes)


def step_context(backend: AttentionBackend, batch: AttentionBatch) -> AttentionContext:
    """What every attention layer gets for this step: the backend's metadata."""
    if batch.num_decodes:
        view = {
            rid: (int(batch.context_lens[i]), batch.block_table[i].tolist())
            for i, rid in enumerate(batch.req_ids[: batch.num_decodes])
        }
        order = backend.order_decodes(list(batch.req_ids[: batch.num_decodes]), view)
        if order != list(batch.req_ids[: batch.num_decodes]):
            raise AssertionError(
                "the backend reordered this batch's decodes; lay them out in its order "
                f"({order}) before building the step"
            )
    return AttentionContext(backend, backend.build_metadata(batch), batch=batch)


def spec_for_model(
    model: torch.nn.Module,
    *,
    block_size: int,
    device: torch.device | str = "cpu",
    max_model_len: int = 512,
    max_num_seqs: int = 16,
) -> AttentionSpec:
    """The spec of a model built from ``enginecore.layers`` (its Attention layers)."""
    from enginecore.layers.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    param = next(model.parameters(), None)
    return AttentionSpec(
        num_layers=len(layers),
        num_heads=layers[0].num_heads,
        num_kv_heads=layers[0].num_kv_heads,
        head_dim=layers[0].head_dim,
        dtype=param.dtype if param is not None else torch.float32,
        device=torch.device(device),
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_model_len,
        sliding_window=any(a.sliding_window is not None for a in layers),
        logits_soft_cap=any(a.logits_soft_cap is not None for a in layers),
    )


def reference_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention in float64, request by request: ``keys[r]``/``values[r]`` are request
    ``r``'s whole sequence [seq_len, H_kv, D]; returns [T, H_q, D] in ``query``'s dtype."""
    out = torch.empty_like(query)
    qsl = batch.query_start_loc
    hq = query.shape[1]
    for r in range(len(batch.query_lens)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        k, v = keys[r].double(), values[r].double()
        g = hq // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        q = query[a:b].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(int(batch.context_lens[r]), int(batch.seq_lens[r]))[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        seen = k_pos <= q_pos
        if sliding_window is not None:
            seen &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~seen[None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def write_sequences(
    kv_cache: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    batch: AttentionBatch,
) -> None:
    """Put each request's context (its first ``context_lens[r]`` positions) into a
    ``[2, blocks, block_size, H, D]`` cache through its block table, as earlier steps
    would have."""
    block_size = kv_cache.shape[2]
    for r in range(len(batch.query_lens)):
        for p in range(int(batch.context_lens[r])):
            block = int(batch.block_table[r, p // block_size])
            kv_cache[0, block, p % block_size] = keys[r][p]
            kv_cache[1, block, p % block_size] = values[r][p]
