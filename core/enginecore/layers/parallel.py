"""Tensor-parallel collectives the layers share (identity at ``tp_size == 1``)."""

from __future__ import annotations

import torch

from enginecore.distributed import ParallelContext


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"{what} ({total}) is not divisible by tensor_parallel_size ({parts}); "
            "choose a tensor_parallel_size that divides it"
        )
    return total // parts


def tp_all_reduce(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place (identity at tp_size 1)."""
    if parallel.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=parallel.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along the last dimension, in rank order."""
    if parallel.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x, group=parallel.tp_group)
    return torch.cat(parts, dim=-1)
