"""Which device and which CPU cores a rank owns, so data-parallel replicas never share them.

Local data-parallel replicas (``data_parallel_backend = "mp"``) run on one host: replica
``i`` owns accelerator ordinals ``i * world_size .. (i + 1) * world_size - 1`` (its ranks
take them in rank order) and, on CPU, its own slice of the cores this process may use. The
frontend tells each replica's process its index (``enginecore.distributed.REPLICA_ENV``); without it (one
replica, a Ray replica, an external launch) the offset is 0. On Ray, the raylet narrows
``CUDA_VISIBLE_DEVICES`` to each actor's GPUs, so no offset is needed there either.
"""

from __future__ import annotations

from enginecore.config import ParallelConfig
from enginecore.errors import EngineCoreError


def accelerator_index(par: ParallelConfig, local_rank: int, replica: int) -> int:
    """The accelerator ordinal of ``local_rank`` in local replica ``replica``."""
    return replica * par.world_size + local_rank


def check_accelerator_index(par: ParallelConfig, index: int, visible: int, replica: int) -> None:
    """A clear error when this host has too few devices for every replica's ranks."""
    if index < visible:
        return
    needed = par.world_size * (par.data_parallel_size if par.data_parallel_backend == "mp" else 1)
    raise EngineCoreError(
        f"data-parallel replica {replica} needs accelerator {index}, but torch sees {visible} "
        f"device(s): data_parallel_size x tensor_parallel_size x pipeline_parallel_size = "
        f"{needed} devices are needed on this host (set CUDA_VISIBLE_DEVICES, lower a size, "
        "or use data_parallel_backend='ray' to spread replicas over nodes)"
    )


def replica_cpu_cores(cores: list[int], par: ParallelConfig, replica: int) -> list[int] | None:
    """The slice of ``cores`` local replica ``replica`` is pinned to, or None (no pinning:
    one replica, or fewer cores than replicas, where sharing is the only choice)."""
    replicas = par.data_parallel_size if par.data_parallel_backend == "mp" else 1
    if replicas <= 1 or len(cores) < replicas:
        return None
    per_replica = len(cores) // replicas
    ordered = sorted(cores)
    return ordered[replica * per_replica : (replica + 1) * per_replica]
