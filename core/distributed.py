"""Where a rank sits in the tensor/pipeline-parallel layout (passed to models and runners)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the parallel layout. ``tp_group`` is a torch.distributed group
    (None when tp_size == 1)."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None
    pp_group: Any = None

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1


SINGLE_RANK = ParallelContext()
