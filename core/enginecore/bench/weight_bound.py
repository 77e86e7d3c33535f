"""The weight-read bound of single-stream decode: bytes a token must read over the
machine's measured memory bandwidth.

A batch-1 decode step reads every weight once (an embedding only one row of it, a
mixture of experts only the experts it routes to), so no engine can decode faster than
``bandwidth / bytes_per_token`` tokens a second. The KV cache's reads are left out: at a
short context they are a small fraction of the weights'.
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
    """``bytes_per_token`` over ``bandwidth`` (bytes/s): the fastest possible decode."""

    bytes_per_token: int
    bandwidth: float

    @property
    def tokens_per_s(self) -> float:
        return self.bandwidth / self.bytes_per_token


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
