"""Paged attention in plain torch (CPU and CUDA).

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K then V). A request owns a list of blocks (its block table); token ``p``
of a request lives in slot ``block_table[p // block_size] * block_size + p %
block_size``.

One step's tokens are flattened into one batch. The runner orders requests so that all
single-token queries (decodes) come first and multi-token chunks (prefills) after; each
group runs as one batched ``scaled_dot_product_attention`` over K/V gathered from the
cache and padded to the group's longest context, with a mask. Query heads that share a
KV head are folded into the query-length axis, so GQA never copies K/V per query head.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from enginecore.builtin_models import cpu_kernels
from enginecore.builtin_models.sliding_window import restrict_to_window


@dataclass
class AttentionGroup:
    """Requests that share one batched SDPA call (all decodes, or all prefills)."""

    token_start: int  # first flattened token of the group
    num_tokens: int
    block_tables: torch.Tensor  # [R, max_blocks] long
    max_query_len: int
    max_kv_len: int  # padded context length = max_blocks * block_size (trimmed)
    mask: torch.Tensor  # [R, 1, max_query_len, max_kv_len] bool, True = attend
    # Flat index (r * max_query_len + i) of each of the group's tokens in the padded
    # [R, max_query_len] query layout; None when every query has length 1.
    pad_index: torch.Tensor | None
    q_pos: torch.Tensor | None = None  # [R, max_query_len] absolute query positions
    # Sliding-window masks, made on first use by a windowed layer and shared by the others.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            mask = self.window_masks[window] = restrict_to_window(self.mask, self.q_pos, window)
        return mask

    @property
    def flat_blocks(self) -> torch.Tensor:
        return self.block_tables.reshape(-1)

    @property
    def num_reqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (CPU is fine; informational)
    seq_lens: torch.Tensor  # [num_reqs]: context + new tokens
    context_lens: torch.Tensor  # [num_reqs]: tokens already in the cache before this step
    max_query_len: int
    max_seq_len: int
    block_size: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    # Set by the runner when the decode group is served from a DecodeMirror this step.
    mirror: Any = None
    # Set by the runner when a KV connector is active (a KVConnectorBridge): each layer
    # waits for its loads before attending and offers its K/V for saving after writing.
    kv_connector: Any = None


def _group_mask(
    context_lens: torch.Tensor, max_q: int, max_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-with-context mask and the query positions: query i of a request (absolute
    position ctx + i) sees keys 0..ctx + i. Padded query rows still see key 0, so no row
    is fully masked (a fully masked row would give NaN in SDPA)."""
    device = context_lens.device
    q_pos = context_lens[:, None] + torch.arange(max_q, device=device)[None, :]  # [R, Q]
    k_idx = torch.arange(max_kv, device=device)
    mask = k_idx[None, None, :] <= q_pos[:, :, None]  # [R, Q, K]
    return mask.unsqueeze(1), q_pos


def build_group(
    token_start: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
) -> AttentionGroup:
    """Describe one group; ``context_lens``/``query_lens`` live on the target device."""
    num_blocks_needed = (max_seq_len + block_size - 1) // block_size
    block_tables = block_tables[:, :num_blocks_needed]
    max_kv = max_seq_len
    mask, q_pos = _group_mask(context_lens, max_query_len, max_kv)
    pad_index = None
    if max_query_len > 1:
        device = query_lens.device
        starts = torch.cumsum(query_lens, 0) - query_lens
        req_of_token = torch.repeat_interleave(
            torch.arange(len(query_lens), device=device), query_lens
        )
        pos_in_req = torch.arange(int(query_lens.sum()), device=device) - starts[req_of_token]
        pad_index = req_of_token * max_query_len + pos_in_req
    return AttentionGroup(
        token_start=token_start,
        num_tokens=int(query_lens.sum()) if pad_index is not None else len(query_lens),
        block_tables=block_tables,
        max_query_len=max_query_len,
        max_kv_len=max_kv,
        mask=mask,
        pad_index=pad_index,
        q_pos=q_pos,
    )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V ([T, H_kv, D]) into their cache slots."""
    kernels = cpu_kernels.kernels_for(kv_cache)
    if (
        kernels is not None
        and cpu_kernels.heads_contiguous(key, value)
        and slot_mapping.dtype == torch.int64
    ):
        kernels.write_kv(kv_cache, key, value, slot_mapping)
        return
    _, num_blocks, block_size, h, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, h, d)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather_kv(kv_cache: torch.Tensor, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each request in the group as [R, H_kv, max_kv, D] (block-wise gather)."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    r, nb = group.block_tables.shape
    # index_select of whole blocks (rows of block_size*H*D) is a plain memcpy per block
    # and several times faster on CPU than advanced indexing.
    kv = kv_cache.view(2, num_blocks, block_size * h * d).index_select(1, group.flat_blocks)
    kv = kv.view(2, r, nb * block_size, h, d)
    kv = kv[:, :, : group.max_kv_len].transpose(2, 3)  # [2, R, H, K, D]
    return kv[0], kv[1]


def _attend_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for the group's tokens; ``query`` is [T_g, H_q, D], returns the same."""
    r = group.num_reqs
    _t, hq, d = query.shape
    key, value = _gather_kv(kv_cache, group)
    hkv = key.shape[1]
    g = hq // hkv
    q_len = group.max_query_len
    if group.pad_index is None:
        q = query.view(r, 1, hq, d)
    else:
        q = query.new_zeros(r * q_len, hq, d)
        q.index_copy_(0, group.pad_index, query)
        q = q.view(r, q_len, hq, d)
    # Fold the G query heads of each KV head into the query axis: [R, H_kv, G*Q, D].
    q = q.view(r, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * q_len, d)
    mask = group.mask_for(window)  # [R, 1, Q, K]
    if g > 1:
        mask = mask.unsqueeze(2).expand(r, 1, g, q_len, mask.shape[-1])
        mask = mask.reshape(r, 1, g * q_len, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    out = out.view(r, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(r * q_len, hq, d)
    if group.pad_index is not None:
        out = out.index_select(0, group.pad_index)
    return out


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Shapes: q [T, H_q, D],
    k/v [T, H_kv, D]; returns [T, H_q, D]. With ``sliding_window`` W each query sees
    only the last W positions up to its own (see ``sliding_window.py``).

    With ``kv_cache=None`` (the memory-profiling pass) every request is treated as a
    fresh prefill over its own tokens (the window does not change memory use).
    """
    if kv_cache is None:
        return _attend_without_cache(query, key, value, meta, scale)
    connector = meta.kv_connector
    if connector is not None:
        connector.wait_for_layer_load(kv_cache)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    if connector is not None:
        connector.save_layer(kv_cache)
    if meta.mirror is not None and meta.decode is not None:
        n = meta.decode.num_tokens
        decoded = meta.mirror.attend(query[:n], key[:n], value[:n], kv_cache, scale, sliding_window)
        if meta.prefill is None:
            return decoded
        out = torch.empty_like(query)
        out[:n] = decoded
        grp = meta.prefill
        sl = slice(grp.token_start, grp.token_start + grp.num_tokens)
        out[sl] = _attend_group(query[sl], kv_cache, grp, scale, sliding_window)
        return out
    groups = [grp for grp in (meta.decode, meta.prefill) if grp is not None]
    if len(groups) == 1:
        return _attend_group(query, kv_cache, groups[0], scale, sliding_window)
    out = torch.empty_like(query)
    for grp in groups:
        sl = slice(grp.token_start, grp.token_start + grp.num_tokens)
        out[sl] = _attend_group(query[sl], kv_cache, grp, scale, sliding_window)
    return out


def _attend_without_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for a, b in itertools.pairwise(starts):
        q = query[a:b].transpose(0, 1)
        k = key[a:b].transpose(0, 1)
        v = value[a:b].transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decodes: int,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for a batch whose first ``num_decodes`` requests have one query token.

    ``block_table`` is [num_reqs, max_blocks] (CPU); everything is moved to ``device``.
    """
    q = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    seq = q + ctx
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=qsl[1:])
    bt = block_table.to(device, non_blocking=True)
    q_dev, ctx_dev = q.to(device), ctx.to(device)
    decode = prefill = None
    if num_decodes > 0:
        decode = build_group(
            0,
            bt[:num_decodes],
            ctx_dev[:num_decodes],
            q_dev[:num_decodes],
            1,
            int(seq[:num_decodes].max()),
            block_size,
        )
    if num_decodes < len(query_lens):
        prefill = build_group(
            int(qsl[num_decodes]),
            bt[num_decodes:],
            ctx_dev[num_decodes:],
            q_dev[num_decodes:],
            int(q[num_decodes:].max()),
            int(seq[num_decodes:].max()),
            block_size,
        )
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        query_start_loc=qsl,
        seq_lens=seq,
        context_lens=ctx,
        max_query_len=int(q.max()) if len(query_lens) else 0,
        max_seq_len=int(seq.max()) if len(query_lens) else 0,
        block_size=block_size,
        decode=decode,
        prefill=prefill,
    )
