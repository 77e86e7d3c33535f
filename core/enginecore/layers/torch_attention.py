"""The ``torch`` attention backend: paged attention in plain torch, on any device.

The reference every other backend is checked against. The KV cache of one layer is
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V); token ``p`` of a
request lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

- Decodes run as one batched ``scaled_dot_product_attention`` over K/V gathered from the
  cache and padded to the longest context, with a mask. The query heads that share a KV
  head are folded into the query axis, so GQA never copies K/V per query head.
- Prefill chunks run in *runs* (``PrefillRun``): consecutive fresh prompts of one length
  share a call that attends to this step's own K/V under SDPA's causal flag (no gather,
  no mask); a chunk with context before it (chunked prefill, a prefix-cache hit,
  speculative verification) gets its own call over its gathered K/V with an additive
  causal bias. Nothing is padded to the step's longest prompt.

The gathers make this backend's workspace grow with the longest context
(:meth:`TorchAttentionBackend.workspace_bytes` reports it to memory profiling); the
``triton`` backend reads the cache in place instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from enginecore.interfaces import AttentionBackend, AttentionCapabilities
from enginecore.layers.attention import Attention, AttentionBatch
from enginecore.layers.attention_masks import decode_mask


@dataclass
class PrefillRun:
    """Prefill requests of a group that share one SDPA call: ``num_reqs`` fresh prompts
    (no context) of ``query_len`` tokens each, or one chunk with ``context_len`` tokens
    of context in the cache."""

    token_start: int  # first token, counted from the group's first
    req_start: int  # first request, counted from the group's first (its block table row)
    num_reqs: int
    query_len: int
    context_len: int
    # Additive masks per (window), made on first use and shared by the step's layers.
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def bias_for(
        self, window: int | None, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """[query_len, context_len + query_len]: 0 where a query sees a key, -inf elsewhere
        (query ``i`` sits at position ``context_len + i``; its own key is always seen)."""
        bias = self.biases.get(window)
        if bias is None:
            ctx, n = self.context_len, self.query_len
            q_pos = torch.arange(ctx, ctx + n, device=device)[:, None]
            k_idx = torch.arange(ctx + n, device=device)[None, :]
            seen = k_idx <= q_pos
            if window is not None:
                seen &= k_idx > q_pos - window
            bias = torch.zeros(seen.shape, dtype=dtype, device=device)
            bias = self.biases[window] = bias.masked_fill_(~seen, float("-inf"))
        return bias


def prefill_runs(query_lens: list[int], context_lens: list[int]) -> list[PrefillRun]:
    """Split a prefill group into runs: consecutive fresh prompts of equal length share a
    run; a chunk with context is a run of its own."""
    runs: list[PrefillRun] = []
    token = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        last = runs[-1] if runs else None
        if ctx == 0 and last is not None and last.context_len == 0 and last.query_len == n:
            last.num_reqs += 1
        else:
            runs.append(PrefillRun(token, i, 1, n, ctx))
        token += n
    return runs


@dataclass
class AttentionGroup:
    """The step's decodes (one batched SDPA call) or its prefill chunks (``runs``)."""

    token_start: int  # first flattened token of the group
    num_tokens: int
    block_tables: torch.Tensor  # [R, max_blocks] long
    max_query_len: int
    max_kv_len: int  # padded context length
    q_pos: torch.Tensor | None = None  # decodes: each row's query position, [R, 1]
    runs: list[PrefillRun] = field(default_factory=list)  # prefill groups only
    # Decode masks per window (None: full), [R, 1, 1, max_kv_len] bool, True = attend.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        mask = self.masks.get(window)
        if mask is None:
            assert self.q_pos is not None, "masks are for decode groups, which have q_pos"
            mask = self.masks[window] = decode_mask(self.q_pos, self.max_kv_len, window)
        return mask

    @property
    def num_reqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class TorchAttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] (host)
    seq_lens: torch.Tensor  # [num_reqs]: context + new tokens (host)
    context_lens: torch.Tensor  # [num_reqs]: tokens in the cache before this step (host)
    max_query_len: int
    max_seq_len: int
    block_size: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None


def build_torch_metadata(
    batch: AttentionBatch, block_size: int, device: torch.device
) -> TorchAttentionMetadata:
    """The torch backend's metadata for ``batch`` (tensors moved to ``device``)."""
    query_lens = batch.query_lens.tolist()
    context_lens = batch.context_lens.tolist()
    num_decodes = batch.num_decodes
    # Host values are read from the numpy arrays: reading a tensor would be a device sync
    # on a GPU.
    q_np = batch.query_lens
    seq_np = batch.seq_lens
    qsl_np = batch.query_start_loc
    ctx = torch.from_numpy(batch.context_lens)
    seq = torch.from_numpy(seq_np)
    qsl = torch.from_numpy(qsl_np)
    bt = torch.from_numpy(batch.block_table).to(device, non_blocking=True)
    decode = prefill = None
    if num_decodes > 0:
        max_seq = int(seq_np[:num_decodes].max())
        decode = AttentionGroup(
            token_start=0,
            num_tokens=num_decodes,
            block_tables=bt[:num_decodes, : -(-max_seq // block_size)],
            max_query_len=1,
            max_kv_len=max_seq,
            q_pos=ctx[:num_decodes].to(device)[:, None],
        )
    if num_decodes < len(query_lens):
        prefill_seq = int(seq_np[num_decodes:].max())
        prefill = AttentionGroup(
            token_start=int(qsl_np[num_decodes]),
            num_tokens=int(q_np[num_decodes:].sum()),
            block_tables=bt[num_decodes:, : -(-prefill_seq // block_size)],
            max_query_len=int(q_np[num_decodes:].max()),
            max_kv_len=prefill_seq,
            runs=prefill_runs(query_lens[num_decodes:], context_lens[num_decodes:]),
        )
    return TorchAttentionMetadata(
        slot_mapping=torch.from_numpy(batch.slot_mapping).to(device, non_blocking=True),
        query_start_loc=qsl,
        seq_lens=seq,
        context_lens=ctx,
        max_query_len=int(q_np.max()) if query_lens else 0,
        max_seq_len=int(seq_np.max()) if query_lens else 0,
        block_size=block_size,
        decode=decode,
        prefill=prefill,
    )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V ([T, H_kv, D]) into their cache slots."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, h, d)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def as_stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded as a KV cache of ``kv_dtype`` holds it, in ``x``'s dtype: every read
    of K/V then sees the same values, from the cache or from this step's tensors."""
    return x if kv_dtype == x.dtype else x.to(kv_dtype).to(x.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``length`` positions of each block table row, as
    [R, H_kv, length, D] (a block-wise gather) in ``dtype`` (a half cache widened)."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    nb = -(-length // block_size)
    r = block_tables.shape[0]
    # index_select of whole blocks (rows of block_size*H*D) is a plain memcpy per block
    # and several times faster on CPU than advanced indexing.
    flat = block_tables[:, :nb].reshape(-1)
    kv = kv_cache.view(2, num_blocks, block_size * h * d).index_select(1, flat)
    kv = kv.view(2, r, nb * block_size, h, d)[:, :, :length].transpose(2, 3)  # [2, R, H, K, D]
    kv = kv.to(dtype)
    return kv[0], kv[1]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """SDPA, or its explicit form where the scores are soft-capped (SDPA has no cap).
    ``q`` [..., Hq, Q, D] and ``k``/``v`` [..., Hkv, K, D] with Hq a multiple of Hkv;
    ``mask`` is bool (True = attend) or additive."""
    hq, hkv = q.shape[-3], k.shape[-3]
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=hq != hkv
        )
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if causal:
        n, m = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops (SDPA over gathered K/V): any device, the oracle."""

    name = "torch"
    capabilities = AttentionCapabilities(
        devices=("cpu", "cuda"), kv_cache_dtypes=("float16", "bfloat16")
    )
    priority = 0

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        return build_torch_metadata(batch, self.spec.block_size, self.spec.device)

    def workspace_bytes(self) -> int:
        """The decode gather at its largest: every sequence padded to ``max_model_len``
        (K and V, plus the mask), one layer at a time."""
        s = self.spec
        rows, length = s.max_num_seqs, s.max_model_len
        elem = torch.empty((), dtype=s.dtype).element_size()
        return rows * length * (2 * s.num_kv_heads * s.head_dim * elem + 1)

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: Any,
    ) -> torch.Tensor:
        if kv_cache is None:
            return self.attend_without_cache(layer, query, key, value, metadata)
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        decode, prefill = metadata.decode, metadata.prefill
        if prefill is not None and kv_cache.dtype != key.dtype:
            # Prompts attend to their own K/V as the cache holds them, so a prompt gives
            # the same result whether its prefix is cached, chunked or computed here.
            key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
        n = decode.num_tokens if decode is not None else 0
        if decode is not None:
            decoded = self.attend_decodes(layer, query[:n], key[:n], value[:n], kv_cache, metadata)
            if prefill is None:
                return decoded
        rest = slice(n, None)
        prefilled = self.attend_prefills(
            layer, query[rest], key[rest], value[rest], kv_cache, prefill
        )
        return prefilled if decode is None else torch.cat((decoded, prefilled))

    # --- the parts a device backend may replace ----------------------------------------

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(kv_cache, key, value, slot_mapping)

    def attend_decodes(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """Attention for the decode group's tokens; ``query`` is [R, H_q, D]."""
        group = metadata.decode
        assert group is not None, "called for a step with decodes"
        r, hq, d = query.shape
        k, v = gather_kv(kv_cache, group.block_tables, group.max_kv_len, query.dtype)
        hkv = k.shape[1]
        # The G query heads of a KV head become its query rows: [R, H_kv, G, D].
        q = query.view(r, hkv, hq // hkv, d)
        mask = group.mask_for(layer.sliding_window)
        if layer.logits_soft_cap is not None:
            q = q.reshape(r, hq, 1, d)  # explicit form: one query row per head
        out = sdpa(
            q, k, v, mask=mask, causal=False, scale=layer.scale, soft_cap=layer.logits_soft_cap
        )
        return out.reshape(r, hq, d)

    def attend_prefills(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        group: AttentionGroup,
        skip_fresh_up_to: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the prefill group's tokens, run by run (see ``PrefillRun``).
        Fresh prompts of at most ``skip_fresh_up_to`` tokens are left as they are in
        ``out`` (a device kernel computed them)."""
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        _, hq, d = query.shape
        hkv = key.shape[1]
        window, cap = layer.sliding_window, layer.logits_soft_cap
        for run in group.runs:
            if run.context_len == 0 and run.query_len <= skip_fresh_up_to:
                continue
            r, n = run.num_reqs, run.query_len
            rows = slice(run.token_start, run.token_start + r * n)
            q = query[rows].view(r, n, hq, d).transpose(1, 2)
            if run.context_len == 0:
                # A fresh prompt's keys are exactly this step's: no gather.
                k = key[rows].view(r, n, hkv, d).transpose(1, 2)
                v = value[rows].view(r, n, hkv, d).transpose(1, 2)
            else:
                table = group.block_tables[run.req_start : run.req_start + r]
                k, v = gather_kv(kv_cache, table, run.context_len + n, query.dtype)
            if run.context_len == 0 and window is None:
                mask, causal = None, True  # SDPA's own causal flag: no mask to read
            else:
                mask, causal = run.bias_for(window, query.dtype, query.device), False
            o = sdpa(q, k, v, mask=mask, causal=causal, scale=layer.scale, soft_cap=cap)
            out[rows] = o.transpose(1, 2).reshape(r * n, hq, d)
        return out

    def attend_without_cache(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_lens: list[int],
    ) -> torch.Tensor:
        """The profiling pass: each request a fresh prompt over its own tokens."""
        out = torch.empty_like(query)
        starts = [0, *itertools.accumulate(query_lens)]
        for a, b in itertools.pairwise(starts):
            q = query[a:b].transpose(0, 1)
            k = key[a:b].transpose(0, 1)
            v = value[a:b].transpose(0, 1)
            o = sdpa(q, k, v, mask=None, causal=True, scale=layer.scale, soft_cap=None)
            out[a:b] = o.transpose(0, 1)
        return out
