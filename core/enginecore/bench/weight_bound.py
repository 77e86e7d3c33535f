"""The read bound of single-stream decode: bytes a token must read over the machine's
measured memory bandwidth.

A batch-1 decode step reads every weight once (an embedding only one row of it, a
mixture of experts only the experts it routes to) and, in attention, every cached key and
value of its context in every layer, so no engine can decode faster than
``bandwidth / bytes_per_token`` tokens a second. Both parts are kept apart so a report
shows each: the weights' bytes are fixed, the K/V bytes grow with the context (counted at
a run's mean context).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
EXPERTS_MARK = "_exps."  # GGUF's stacked expert tensors: blk.N.ffn_{gate,up,down}_exps.weight


@dataclass(frozen=True)
class Bound:
    """The bytes a token reads (weights plus K/V) over ``bandwidth`` (bytes/s): the
    fastest possible decode."""

    weight_bytes: int
    kv_bytes: int
    bandwidth: float

    @property
    def bytes_per_token(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.bandwidth / self.bytes_per_token


def kv_itemsize(kv_cache_dtype: str = "auto") -> int:
    """Bytes of one K/V element of a GGUF file served on CPU: ``auto`` keeps its K/V in
    float16 (in bfloat16 under a bfloat16 model), so only ``float32`` takes four."""
    return 4 if kv_cache_dtype == "float32" else 2


def mean_decode_context(prompt_len: int, decode_steps: int) -> float:
    """The mean number of positions a decode step attends over when ``decode_steps``
    steps follow a ``prompt_len`` prompt: the k-th step (k = 1..decode_steps) writes
    position ``prompt_len + k - 1`` and attends over ``prompt_len + k`` positions."""
    return prompt_len + (decode_steps + 1) / 2


def gguf_kv_bytes_per_position(path: str | os.PathLike[str], itemsize: int = 4) -> int:
    """Bytes of K and V one cached position holds over all layers, as decode attention
    reads them: ``layers x kv_heads x (key size + value size) x itemsize`` (``itemsize``
    of the K/V dtype: 4 for the CPU's float32 decode mirror). Head counts given per layer
    (an array) are summed layer by layer."""
    from enginecore.block_formats.gguf_reader import GGUFMetadata

    meta = GGUFMetadata(path)
    arch = meta.field("general.architecture")
    layers = int(meta.field(f"{arch}.block_count"))
    heads = meta.field(f"{arch}.attention.head_count")
    kv_heads = meta.field(f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv_heads is None else kv_heads
    per_layer = list(kv_heads) if isinstance(kv_heads, (list, tuple)) else [kv_heads] * layers
    first_heads = heads[0] if isinstance(heads, (list, tuple)) else heads
    default_size = int(meta.field(f"{arch}.embedding_length")) // int(first_heads)
    key = int(meta.field(f"{arch}.attention.key_length") or default_size)
    value = int(meta.field(f"{arch}.attention.value_length") or default_size)
    return sum(int(h) for h in per_layer) * (key + value) * itemsize


def gguf_kv_bytes_per_token(path: str | os.PathLike[str], context: float, itemsize: int = 4) -> int:
    """The K/V bytes one decode step reads at a mean ``context`` positions."""
    return round(gguf_kv_bytes_per_position(path, itemsize) * context)


def gguf_bytes_per_token(path: str | os.PathLike[str]) -> int:
    """The bytes of a GGUF file's weights one decode step reads, at the file's formats:
    every tensor once, the token embedding one row (all of it again when it doubles as
    the output head, i.e. the file has no ``output.weight``), stacked experts only the
    share ``expert_used_count / expert_count`` of them."""
    from enginecore.block_formats.gguf_reader import GGUFMetadata

    meta = GGUFMetadata(path)
    arch = meta.field("general.architecture")
    experts = int(meta.field(f"{arch}.expert_count") or 0)
    used = int(meta.field(f"{arch}.expert_used_count") or 0)
    names = {t.name for t in meta.tensors}
    total = 0
    for tensor in meta.tensors:
        if tensor.name == EMBEDDING:
            rows = tensor.shape[-1] if len(tensor.shape) > 1 else 1
            total += tensor.n_bytes // max(rows, 1)
            if OUTPUT not in names:
                total += tensor.n_bytes
        elif EXPERTS_MARK in tensor.name and experts and used:
            total += tensor.n_bytes * used // experts
        else:
            total += tensor.n_bytes
    return total


def gguf_decode_bound(
    path: str | os.PathLike[str],
    prompt_len: int,
    decode_steps: int,
    bandwidth: float,
    kv_itemsize: int = 4,
) -> Bound:
    """The read bound of ``decode_steps`` single-stream steps after a ``prompt_len``
    prompt: the file's weight bytes a step reads plus its K/V at the mean context."""
    context = mean_decode_context(prompt_len, decode_steps)
    return Bound(
        gguf_bytes_per_token(path),
        gguf_kv_bytes_per_token(path, context, kv_itemsize),
        bandwidth,
    )


def measured_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s this process reads from memory with torch's threads: the best of
    ``repeats`` sums over a buffer far larger than any CPU cache."""
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    buffer.sum()  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t0)
    return buffer.numel() * 4 / best
