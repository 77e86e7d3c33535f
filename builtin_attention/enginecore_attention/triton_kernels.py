"""Paged attention in Triton: K/V written into and read from the block-paged cache in place.

The cache is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V).
A request's tokens live in the blocks its row of the block table names, so attention gathers
each key through that table while it streams over the context: no dense per-request copy, and
no workspace that grows with the longest context.

One kernel serves a whole mixed batch (decodes, fresh prefills, prefills on top of cached
context, speculative verification). Each program owns one tile of one request's queries and
one KV head; the ``G`` query heads that share the KV head are stacked into the tile's rows, so
every key and value loaded is used by all of them (GQA). Scores run through an online softmax
in fp32. When a batch is too small to fill the GPU (a few long decodes), the KV range of each
tile is cut into splits that run as separate programs, and a second kernel merges their
partial results (split-KV, "flash decoding").

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels run on the
CPU through Triton's interpreter, which is how the test suite checks them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "MAX_HEAD_SIZE",
    "SUPPORTED_DTYPES",
    "default_kv_splits",
    "is_interpreted",
    "paged_attention",
    "write_kv",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Splitting the KV range pays only when each split still streams a fair amount of context.
_MIN_KEYS_PER_SPLIT = 512
_MAX_KV_SPLITS = 16
# Beyond this the query tile and a K/V tile no longer fit in shared memory together.
MAX_HEAD_SIZE = 256


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_key_dim,
    stride_value_tok,
    stride_value_head,
    stride_value_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_dim,
    num_kv_heads,
    head_size,
    block_size,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    # One program per token: all of its KV heads move in one [heads, dims] tile.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_size)
    key = tl.load(
        key_ptr
        + token * stride_key_tok
        + heads[:, None] * stride_key_head
        + dims[None, :] * stride_key_dim,
        mask=mask,
    )
    value = tl.load(
        value_ptr
        + token * stride_value_tok
        + heads[:, None] * stride_value_head
        + dims[None, :] * stride_value_dim,
        mask=mask,
    )
    dst = (
        cache_ptr
        + block * stride_cache_block
        + offset * stride_cache_offset
        + heads[:, None] * stride_cache_head
        + dims[None, :] * stride_cache_dim
    )
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    stride_query_tok,
    stride_query_head,
    stride_query_dim,
    stride_out_tok,
    stride_out_head,
    stride_out_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_dim,
    stride_table_req,
    stride_table_block,
    num_reqs,
    num_q_heads,
    head_size,
    block_size,
    scale,
    soft_cap,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Request r's query tiles are numbered from query_start_loc[r] // BLOCK_Q + r. That bound
    # needs no device-to-host sync to size the grid (T // BLOCK_Q + R tiles in all) and leaves
    # room for every tile of every request; the few spare ids exit below. The owning request is
    # the last one whose first tile id is <= ours: a binary search over query_start_loc.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + (num_reqs - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = mid_first_tile <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    req = lo

    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_first = (tile_id - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # keys already cached before this step's queries

    # Row m of the tile is query token q_first + m // GROUP_PAD, query head m % GROUP_PAD of
    # this KV head's group. GROUP_PAD rounds the group up to a power of two; spare rows mask off.
    rows = tl.arange(0, BLOCK_M)
    row_tok = q_first + rows // GROUP_PAD
    row_head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (row_tok < q_len) & (rows % GROUP_PAD < GROUP)
    row_pos = context_len + row_tok
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < head_size
    row_mask = row_valid[:, None] & dim_valid[None, :]
    tok = (q_begin + row_tok).to(tl.int64)
    q = tl.load(
        query_ptr
        + tok[:, None] * stride_query_tok
        + row_head[:, None] * stride_query_head
        + dims[None, :] * stride_query_dim,
        mask=row_mask,
        other=0.0,
    )
    q = q.to(cache_ptr.dtype.element_ty)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # The keys any row of this tile can see: up to the last row's position, and (with a window)
    # no further back than the first row's window reaches. Tiles start on BLOCK_N boundaries.
    q_last = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    kv_end = context_len + q_last + 1
    kv_begin = context_len * 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + q_first - window + 1, 0)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    num_kv_tiles = tl.cdiv(kv_end - kv_begin, BLOCK_N)
    tiles_per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

    # Scores are kept in log2 units so the softmax can use exp2. The running max starts at a
    # finite floor rather than -inf: a row that sees no key in a tile then keeps alpha = 1 and
    # p = 0 instead of producing inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + req.to(tl.int64) * stride_table_req
    head_base = cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    for kv_tile in range(tile_lo, tile_hi):
        kv_pos = kv_begin + kv_tile * BLOCK_N + cols
        kv_valid = kv_pos < kv_end
        # Each key position is looked up in the block table on its own, so BLOCK_N need not
        # match the cache's block size (a tile may span several blocks or part of one).
        block = tl.load(
            table_row + (kv_pos // block_size) * stride_table_block, mask=kv_valid, other=0
        ).to(tl.int64)
        kv_ptrs = (
            head_base
            + block[:, None] * stride_cache_block
            + (kv_pos % block_size)[:, None] * stride_cache_offset
            + dims[None, :] * stride_cache_dim
        )
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            # cap * tanh(s / cap), with tanh(x) = 2 * sigmoid(2x) - 1 (no tanh in core tl).
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
        s = s * 1.4426950408889634  # log2(e)
        visible = kv_valid[None, :] & (kv_pos[None, :] <= row_pos[:, None])
        if USE_WINDOW:
            visible = visible & (kv_pos[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptrs + stride_cache_kv, mask=kv_mask, other=0.0)
        p = p.to(v.dtype)  # 16-bit caches: p is rounded like V for the second product
        if DOT_IN_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Spare rows (past the request or the group) saw no key; keep them free of 0 / 0.
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + tok[:, None] * stride_out_tok
            + row_head[:, None] * stride_out_head
            + dims[None, :] * stride_out_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        # Partial results, laid out [token, q_head, split(, dim)]; a split that saw no key for
        # a row stores max = floor and sum = 0, which the merge weighs as zero.
        partial_row = (tok * num_q_heads + row_head) * NUM_SPLITS + split
        tl.store(
            partial_acc_ptr + partial_row[:, None] * HEAD_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(partial_max_ptr + partial_row, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial_row, l_i, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    num_reqs,
    stride_out_tok,
    stride_out_head,
    stride_out_dim,
    num_q_heads,
    head_size,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    # One program per (token, query head): rescale each split's sums to the common max.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Tokens past the batch's last request (padding) have no partials to merge.
    if tok >= tl.load(query_start_loc_ptr + num_reqs):
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    partial_row = (tok * num_q_heads + head) * NUM_SPLITS + splits
    split_max = tl.load(partial_max_ptr + partial_row, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + partial_row, mask=split_valid, other=0.0)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(
        partial_acc_ptr + partial_row[:, None] * HEAD_PAD + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    weight = tl.exp2(split_max - tl.max(split_max, 0))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
    tl.store(
        out_ptr + tok * stride_out_tok + head * stride_out_head + dims * stride_out_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_size,
    )


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def is_interpreted() -> bool:
    """True when the kernels run on Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(_paged_attention_kernel, InterpretedFunction)


def write_kv(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter this step's keys and values into the paged cache.

    ``key``/``value`` are ``[T, H_kv, D]``; ``kv_cache`` is ``[2, num_blocks, block_size, H_kv,
    D]`` (K then V); ``slot_mapping`` is ``[T]`` (int64 or int32) with ``slot = block_id *
    block_size + offset``. A negative slot marks a padding token and is skipped. Values are cast
    to the cache's dtype.
    """
    _check_cache(kv_cache)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"write_kv: key and value must both be [tokens, kv_heads, head_size]; got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_size = key.shape
    if (num_kv_heads, head_size) != tuple(kv_cache.shape[3:]):
        raise ValueError(
            f"write_kv: key/value have {num_kv_heads} heads of size {head_size}, the cache "
            f"holds {kv_cache.shape[3]} heads of size {kv_cache.shape[4]}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"write_kv: slot_mapping must be int32/int64 of shape ({num_tokens},); got "
            f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}"
        )
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"write_kv: {name} dtype {t.dtype} is not supported")
    _check_same_device("write_kv", kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    with _on_device(kv_cache.device):
        _launch_write_kv(key, value, kv_cache, slot_mapping)


def _launch_write_kv(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        num_kv_heads,
        head_size,
        kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
    )


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    out: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_kv_splits: int | None = None,
) -> None:
    """Causal attention for a mixed batch, reading K/V in place from the paged cache.

    ``query``/``out`` are ``[T, H_q, D]`` with ``H_q`` a multiple of the cache's ``H_kv``.
    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r + 1]``; ``seq_lens[r]``
    counts its keys in the cache after this step's write, so its ``i``-th query sits at position
    ``seq_lens[r] - q_len + i`` and sees keys ``(pos - sliding_window, pos]`` (``[0, pos]``
    without a window). ``block_table[r]`` lists the request's cache blocks in order. Scores are
    ``scale * q.k``, soft-capped to ``cap * tanh(s / cap)`` when ``logits_soft_cap`` is set.
    ``max_query_len``/``max_seq_len`` describe the batch without a device sync; they only
    steer tile sizes and the split count, so results are right for any lengths the tensors
    hold (a captured CUDA graph can be replayed on other batches of the same token count).
    Rows of ``out`` past ``query_start_loc[-1]`` (padding) are left unwritten. Nothing here
    syncs with the device or reads its memory on the host.

    ``num_kv_splits`` forces the number of split-KV programs per query tile; by default one,
    or more on a GPU when the batch has too few tiles to fill it and contexts are long.
    """
    _check_attention_args(
        query,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        max_query_len,
        max_seq_len,
        sliding_window,
        logits_soft_cap,
        num_kv_splits,
    )
    num_tokens, num_reqs = query.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    if num_kv_splits is None:
        num_kv_splits = default_kv_splits(
            query,
            kv_cache,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
    with _on_device(kv_cache.device):
        _launch_attention(
            query,
            kv_cache,
            out,
            query_start_loc,
            seq_lens,
            block_table,
            _TilePlan.for_batch(query, kv_cache, max_query_len),
            num_kv_splits,
            scale,
            sliding_window,
            logits_soft_cap,
        )


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _launch_attention(
    query: Tensor,
    kv_cache: Tensor,
    out: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    tiles: _TilePlan,
    num_kv_splits: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> None:
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    num_q_tiles = num_tokens // tiles.block_q + num_reqs
    # Decided from the arguments alone, never from max_seq_len: a CUDA graph captured on short
    # sequences is replayed on longer ones.
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    soft_cap = logits_soft_cap if logits_soft_cap is not None and logits_soft_cap > 0 else 0.0
    use_window = window > 0
    use_soft_cap = soft_cap > 0
    # Triton's interpreter multiplies bf16 operands of tl.dot as their raw 16-bit patterns, so
    # there the bf16 tiles are widened first. Products of bf16 values are exact in fp32, so this
    # matches what the GPU computes up to summation order.
    dot_in_fp32 = is_interpreted() and kv_cache.dtype == torch.bfloat16

    if num_kv_splits > 1:
        partial_acc = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits, tiles.head_pad),
            dtype=torch.float32,
            device=query.device,
        )
        partial_max = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_acc = partial_max = partial_sum = out  # never touched by the kernel

    _paged_attention_kernel[(num_q_tiles, num_kv_heads, num_kv_splits)](
        query,
        kv_cache,
        out,
        partial_acc,
        partial_max,
        partial_sum,
        query_start_loc,
        seq_lens,
        block_table,
        *query.stride(),
        *out.stride(),
        *kv_cache.stride(),
        *block_table.stride(),
        num_reqs,
        num_q_heads,
        head_size,
        kv_cache.shape[2],
        float(scale),
        float(soft_cap),
        int(window),
        GROUP=tiles.group,
        GROUP_PAD=tiles.group_pad,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
        HEAD_PAD=tiles.head_pad,
        NUM_SPLITS=num_kv_splits,
        USE_WINDOW=use_window,
        USE_SOFT_CAP=use_soft_cap,
        # fp32 caches get exact fp32 products (tl.dot would otherwise use TF32 on NVIDIA).
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            partial_acc,
            partial_max,
            partial_sum,
            query_start_loc,
            num_reqs,
            *out.stride(),
            num_q_heads,
            head_size,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            HEAD_PAD=tiles.head_pad,
        )


@dataclasses.dataclass(frozen=True)
class _TilePlan:
    """Tile shapes of one launch (all powers of two, as tl.arange needs)."""

    group: int  # query heads per KV head
    group_pad: int
    head_pad: int  # head size padded up, at least 16 (the smallest tl.dot)
    block_q: int  # query tokens per tile; a tile holds block_q * group_pad rows
    block_n: int  # keys per KV tile

    @classmethod
    def for_batch(cls, query: Tensor, kv_cache: Tensor, max_query_len: int) -> _TilePlan:
        group = query.shape[1] // kv_cache.shape[3]
        group_pad = triton.next_power_of_2(group)
        head_pad = max(16, triton.next_power_of_2(query.shape[2]))
        row_bytes = head_pad * kv_cache.element_size()
        # At least 16 rows (the smallest tl.dot); 64 once the batch has prefills worth filling
        # them with, 32 for fp32 x 256 rows so the tiles fit the ~100 KB of shared memory of
        # consumer GPUs.
        rows = 16 if max_query_len * group_pad <= 16 else (64 if row_bytes <= 512 else 32)
        block_q = max(1, rows // group_pad)
        # 16 KB of K per tile (64 keys of bf16 x 128), at least 16 keys.
        block_n = max(16, 16384 // row_bytes)
        return cls(group, group_pad, head_pad, block_q, block_n)


def default_kv_splits(
    query: Tensor, kv_cache: Tensor, *, num_reqs: int, max_query_len: int, max_seq_len: int
) -> int:
    """How many split-KV programs ``paged_attention`` gives each query tile by default.

    One, unless on a GPU whose SMs the batch's programs would leave mostly idle and whose
    contexts are long enough to share out (at least ``_MIN_KEYS_PER_SPLIT`` keys per split).
    """
    if query.device.type != "cuda" or is_interpreted():
        return 1
    tiles = _TilePlan.for_batch(query, kv_cache, max_query_len)
    num_q_tiles = query.shape[0] // tiles.block_q + num_reqs
    num_programs = num_q_tiles * kv_cache.shape[3]
    target = 2 * _multiprocessor_count(query.device.index)
    if num_programs >= target:
        return 1
    by_length = int(triton.cdiv(max_seq_len, _MIN_KEYS_PER_SPLIT))
    by_occupancy = int(triton.cdiv(target, num_programs))
    return max(1, min(_MAX_KV_SPLITS, by_length, by_occupancy))


@functools.cache
def _multiprocessor_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()
    ).multi_processor_count


# ---------------------------------------------------------------------------------------------
# Argument checks (shapes, dtypes and devices only: nothing here reads device memory)
# ---------------------------------------------------------------------------------------------


def _check_cache(kv_cache: Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size]; got "
            f"{tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} is not supported by the triton kernels "
            f"(supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)})"
        )
    if kv_cache.device.type == "cpu" and not is_interpreted():
        raise RuntimeError(
            "the triton attention kernels need a CUDA or ROCm device; to run them on the CPU "
            "set TRITON_INTERPRET=1 before enginecore_attention.triton_kernels is "
            "imported"
        )


def _check_same_device(where: str, reference: Tensor, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.device != reference.device:
            raise ValueError(
                f"{where}: {name} is on {t.device} but kv_cache is on {reference.device}"
            )


def _check_attention_args(
    query: Tensor,
    kv_cache: Tensor,
    out: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    num_kv_splits: int | None,
) -> None:
    _check_cache(kv_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, q_heads, head_size]; got {tuple(query.shape)}")
    if out.shape != query.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, query {tuple(query.shape)}")
    num_q_heads, head_size = query.shape[1:]
    num_kv_heads, cache_head_size = kv_cache.shape[3:]
    if head_size != cache_head_size:
        raise ValueError(f"query head_size {head_size} != kv_cache head_size {cache_head_size}")
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(
            f"head_size {head_size} is above the {MAX_HEAD_SIZE} the triton kernels support"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != kv_cache dtype {kv_cache.dtype}")
    if out.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out dtype {out.dtype} is not supported")
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_reqs < 0:
        raise ValueError(f"seq_lens must be [num_reqs]; got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_reqs + 1] = [{num_reqs + 1}]; got "
            f"{tuple(query_start_loc.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table must be [num_reqs, max_blocks] with num_reqs = {num_reqs}; got "
            f"{tuple(block_table.shape)}"
        )
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    if max_query_len < 0 or max_seq_len < max_query_len:
        raise ValueError(
            f"max_query_len={max_query_len} and max_seq_len={max_seq_len} are inconsistent"
        )
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be positive or None; got {sliding_window}")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be positive or None; got {logits_soft_cap}")
    if num_kv_splits is not None and not 1 <= num_kv_splits <= 256:
        raise ValueError(f"num_kv_splits must be in [1, 256]; got {num_kv_splits}")
    _check_same_device(
        "paged_attention",
        kv_cache,
        query=query,
        out=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
    )
