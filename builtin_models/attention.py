"""Paged attention in plain torch (CPU and CUDA).

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K then V). A request owns a list of blocks (its block table); token ``p``
of a request lives in slot ``block_table[p // block_size] * block_size + p %
block_size``.

One step's tokens are flattened into one batch. The runner orders requests so that all
single-token queries (decodes) come first and multi-token chunks (prefills) after.

- Decodes run as one batched ``scaled_dot_product_attention`` over K/V gathered from the
  cache and padded to the longest context, with a mask (or from the runner's
  ``DecodeMirror``). The query heads that share a KV head are folded into the query axis,
  so GQA never copies K/V per query head.
- Prefill chunks run in *runs* (``PrefillRun``): consecutive fresh prompts of one length
  share a call that attends to this step's own K/V under SDPA's causal flag (no gather,
  no mask); a chunk with context before it (chunked prefill, a prefix-cache hit) gets its
  own call over its gathered K/V with an additive causal bias. Nothing is padded to the
  step's longest prompt: with prompts of 32 and 512 tokens in one step, a padded batch
  did several times the attention work. In float32 on the CPUs that run enginecore's own
  GEMM (``panel_gemm.preferred``: AVX2 without AVX-512), the fresh prompts (up to a
  length) go to one call of the C kernel ``prefill_attention`` instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from enginecore.builtin_models import cpu_kernels, panel_gemm
from enginecore.builtin_models.sliding_window import decode_mask
from enginecore.builtin_models.soft_cap import soft_capped_attention


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
    # Additive masks per sliding window (None: full causal), made on first use and shared
    # by the step's layers.
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
    max_kv_len: int  # padded context length = max_blocks * block_size (trimmed)
    # Decodes: each row's query position, [R, 1].
    q_pos: torch.Tensor | None = None
    runs: list[PrefillRun] = field(default_factory=list)  # prefill groups only
    # Decode masks per sliding window (None: full), [R, 1, 1, max_kv_len] bool, True =
    # attend: made on first use (the decode mirror's kernel needs none) and shared by
    # the step's layers.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    # Prefill groups: the first token and length of each fresh prompt the CPU kernel
    # takes, as int64 tensors, per length limit; made on first use.
    _fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        mask = self.masks.get(window)
        if mask is None:
            mask = self.masks[window] = decode_mask(self.q_pos, self.max_kv_len, window)
        return mask

    def fresh_prompts(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[first token, length] of every prompt of at most ``max_len`` tokens in a run
        without context (a prefill group's), counted from the group's first token."""
        if max_len not in self._fresh:
            starts, lens = [], []
            for run in self.runs:
                if run.context_len == 0 and run.query_len <= max_len:
                    starts += range(
                        run.token_start,
                        run.token_start + run.num_reqs * run.query_len,
                        run.query_len,
                    )
                    lens += [run.query_len] * run.num_reqs
            self._fresh[max_len] = (
                torch.tensor(starts, dtype=torch.int64),
                torch.tensor(lens, dtype=torch.int64),
            )
        return self._fresh[max_len]

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


def build_decode_group(
    block_tables: torch.Tensor, context_lens: torch.Tensor, max_seq_len: int, block_size: int
) -> AttentionGroup:
    """The decode group: one query per request at position ``context_lens`` (on the target
    device), which sees keys ``0..context_len``."""
    num_blocks_needed = (max_seq_len + block_size - 1) // block_size
    return AttentionGroup(
        token_start=0,
        num_tokens=len(context_lens),
        block_tables=block_tables[:, :num_blocks_needed],
        max_query_len=1,
        max_kv_len=max_seq_len,
        q_pos=context_lens[:, None],
    )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V ([T, H_kv, D]) into their cache slots."""
    kernels = cpu_kernels.kernels_for(kv_cache, key, value)
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


def _gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``length`` positions of each block table row, as
    [R, H_kv, length, D] (a block-wise gather)."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    nb = -(-length // block_size)
    r = block_tables.shape[0]
    # index_select of whole blocks (rows of block_size*H*D) is a plain memcpy per block
    # and several times faster on CPU than advanced indexing.
    flat = block_tables[:, :nb].reshape(-1)
    kv = kv_cache.view(2, num_blocks, block_size * h * d).index_select(1, flat)
    kv = kv.view(2, r, nb * block_size, h, d)[:, :, :length].transpose(2, 3)  # [2, R, H, K, D]
    return kv[0], kv[1]


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """SDPA over [..., H, L, D] (K/V may have fewer heads: GQA), soft-capped where asked."""
    if soft_cap is not None:
        return soft_capped_attention(q, k, v, scale=scale, mask=mask, causal=causal, cap=soft_cap)
    gqa = k.shape[-3] != q.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )


def _attend_decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention for the decode group's tokens; ``query`` is [R, H_q, D], returns the same."""
    r, hq, d = query.shape
    key, value = _gather_kv(kv_cache, group.block_tables, group.max_kv_len)
    hkv = key.shape[1]
    # The G query heads of a KV head become its query rows: [R, H_kv, G, D].
    q = query.view(r, hkv, hq // hkv, d)
    mask = group.mask_for(window)
    out = _sdpa(q, key, value, mask=mask, scale=scale, soft_cap=soft_cap)
    return out.reshape(r, hq, d)


def _attend_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention for the prefill group's tokens, run by run (see ``PrefillRun``).

    ``query`` [T_g, H_q, D] and this step's ``key``/``value`` [T_g, H_kv, D]; returns
    [T_g, H_q, D]. On CPU in float32 the fresh prompts up to a length go to the fused
    kernel in one call (``prefill_attention``: 1.7-2x SDPA on prompts of 32-512 tokens)."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _, hq, d = query.shape
    hkv = key.shape[1]
    fused_len = 0  # fresh prompts up to this length take the kernel
    plain = window is None and soft_cap is None  # what the C kernel computes
    kernels = cpu_kernels.kernels_for(query, key, value, out) if plain else None
    # Where enginecore's GEMM is preferred: the kernel runs on its tile, measured there.
    if (
        kernels is not None
        and cpu_kernels.heads_contiguous(query, key, value)
        and panel_gemm.preferred()
    ):
        fused_len = cpu_kernels.prefill_attention_max_len(kernels, d)
        starts, lens = group.fresh_prompts(fused_len)
        if len(starts):
            kernels.prefill_attention(query, key, value, starts, lens, scale, out)
    for run in group.runs:
        if run.context_len == 0 and run.query_len <= fused_len:
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
            k, v = _gather_kv(kv_cache, table, run.context_len + n)
        if run.context_len == 0 and window is None:
            mask, causal = None, True  # SDPA's own causal flag: no mask to read
        else:
            mask, causal = run.bias_for(window, query.dtype, query.device), False
        o = _sdpa(q, k, v, mask=mask, causal=causal, scale=scale, soft_cap=soft_cap)
        out[rows] = o.transpose(1, 2).reshape(r * n, hq, d)
    return out


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Shapes: q [T, H_q, D],
    k/v [T, H_kv, D]; returns [T, H_q, D]. With ``sliding_window`` W each query sees
    only the last W positions up to its own (see ``sliding_window.py``); with
    ``logits_soft_cap`` C the scores are ``C * tanh(scores / C)`` (Gemma 2).

    With ``kv_cache=None`` (the memory-profiling pass) every request is treated as a
    fresh prefill over its own tokens (the window does not change memory use).
    """
    if kv_cache is None:
        return _attend_without_cache(query, key, value, meta, scale, logits_soft_cap)
    connector = meta.kv_connector
    if connector is not None:
        connector.wait_for_layer_load(kv_cache)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    if connector is not None:
        connector.save_layer(kv_cache)
    decode, prefill = meta.decode, meta.prefill
    n = decode.num_tokens if decode is not None else 0
    if decode is not None:
        # The mirror's kernels do not soft-cap: such layers read the paged cache.
        if meta.mirror is not None and logits_soft_cap is None:
            decoded = meta.mirror.attend(
                query[:n], key[:n], value[:n], kv_cache, scale, sliding_window
            )
        else:
            decoded = _attend_decodes(
                query[:n], kv_cache, decode, scale, sliding_window, logits_soft_cap
            )
        if prefill is None:
            return decoded
    rest = slice(n, None)
    prefilled = _attend_prefills(
        query[rest],
        key[rest],
        value[rest],
        kv_cache,
        prefill,
        scale,
        sliding_window,
        logits_soft_cap,
    )
    if decode is None:
        return prefilled
    return torch.cat((decoded, prefilled))


def _attend_without_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for a, b in itertools.pairwise(starts):
        q = query[a:b].transpose(0, 1)
        k = key[a:b].transpose(0, 1)
        v = value[a:b].transpose(0, 1)
        o = _sdpa(q, k, v, causal=True, scale=scale, soft_cap=soft_cap)
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
    ctx_dev = ctx.to(device)
    decode = prefill = None
    if num_decodes > 0:
        decode = build_decode_group(
            bt[:num_decodes], ctx_dev[:num_decodes], int(seq[:num_decodes].max()), block_size
        )
    if num_decodes < len(query_lens):
        prefill_seq = seq[num_decodes:]
        prefill = AttentionGroup(
            token_start=int(qsl[num_decodes]),
            num_tokens=int(q[num_decodes:].sum()),
            block_tables=bt[num_decodes:, : -(-int(prefill_seq.max()) // block_size)],
            max_query_len=int(q[num_decodes:].max()),
            max_kv_len=int(prefill_seq.max()),
            runs=prefill_runs(query_lens[num_decodes:], context_lens[num_decodes:]),
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
