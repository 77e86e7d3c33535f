"""Pipeline-parallel helpers: which layers this stage runs, and a stand-in for the rest."""

from __future__ import annotations

from torch import nn

from enginecore.distributed import ParallelContext


class PPMissingLayer(nn.Identity):
    """Stands in for a layer that lives on another pipeline stage (no parameters)."""


def pp_layer_range(num_layers: int, parallel: ParallelContext) -> tuple[int, int]:
    """``[start, end)`` of the layers this pipeline stage runs (earlier stages take the
    remainder)."""
    if num_layers < parallel.pp_size:
        raise ValueError(
            f"pipeline_parallel_size {parallel.pp_size} exceeds the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, parallel.pp_size)
    start = parallel.pp_rank * base + min(parallel.pp_rank, extra)
    return start, start + base + (1 if parallel.pp_rank < extra else 0)
