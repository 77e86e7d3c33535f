"""The fused decode step while its library is still compiling.

A first start compiles ``decode_step.c`` (with the kernels it calls) in the background
while the weights load; the engine does not wait for it. Until the library has landed
in the cache the layers serve every step (the same tokens, a few per-layer calls more);
the first step after it lands records the model and runs fused from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from enginecore.layers.attention import AttentionBatch
from enginecore_cpu import cpu_kernels

# How often a step asks whether the library has landed (a stat of one file).
_CHECK_EVERY_S = 0.25


class DeferredDecodeStep:
    """Stands in for a :class:`~enginecore_cpu.decode_step.FusedDecodeStep`: declines
    every step until ``landed()`` says the library is built, then makes the step with
    ``make`` (None: this model takes no fused step) and hands it every step it takes."""

    def __init__(self, make: Callable[[], Any], landed: Callable[[], bool]) -> None:
        self._make, self._landed = make, landed
        self.step: Any = None
        self._declined = False  # ``make`` gave None: the layers serve for good
        self._next_check = 0.0

    @property
    def steps(self) -> int:
        """Steps run fused (0 while the library compiles)."""
        return 0 if self.step is None else int(self.step.steps)

    @property
    def has_head(self) -> bool:
        """Whether the step, once made, computes the LM head too (``run``'s ``head``)."""
        return self.step is not None and bool(self.step.has_head)

    def handles(self, batch: AttentionBatch) -> bool:
        if self.step is None:
            if self._declined or time.monotonic() < self._next_check:
                return False
            self._next_check = time.monotonic() + _CHECK_EVERY_S
            cpu_kernels.adopt_landed()  # the kernels the step calls, before it is made
            if not self._landed():
                return False
            self.step = self._make()
            if self.step is None:
                self._declined = True
                return False
        return bool(self.step.handles(batch))

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        threads: int | None = None,
        head: str | None = None,
        tokens_into: np.ndarray | None = None,
    ) -> torch.Tensor:
        assert self.step is not None, "run() follows a handles() that took the step"
        out: torch.Tensor = self.step.run(
            ids, positions, batch, threads=threads, head=head, tokens_into=tokens_into
        )
        return out
