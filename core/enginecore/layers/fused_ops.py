"""Fused kernels for the small steps every model shares, provided by an attention backend.

The layers compute norms, rotary embeddings, the gated activation and the greedy argmax
in plain torch. An attention backend may hand the runner a :class:`FusedOps` whose
methods do the same work faster on its device (the ``cpu`` backend's C kernels). Each
method returns ``None`` when it does not take the given tensors (wrong dtype, layout or
device), and the layer falls back to torch, so a backend implements only what it has.
The runner installs the backend's ops on every layer after loading
(:func:`install_fused_ops`); nothing here is global state.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


class FusedOps:
    """Defaults: nothing fused. Override the methods your device has kernels for."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """RMS norm of ``x`` [T, D]; with ``residual``: ``residual += x`` in place first,
        and the norm of the sum."""
        return None

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """Rotate ``x`` [T, H, D] in place (neox halves) with the tables' rows at
        ``positions``; ``cos`` is ``[cos, cos]`` and ``sin`` is ``[-sin, sin]``."""
        return None

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of ``x`` = [gate | up]."""
        return None

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """Index of each row's maximum, the first on ties (as ``torch.argmax``)."""
        return None


NO_FUSED_OPS = FusedOps()


def install_fused_ops(model: nn.Module, ops: FusedOps) -> None:
    """Give every layer of ``model`` that can use fused ops (an ``ops`` attribute) these."""
    for module in model.modules():
        if isinstance(module, _UsesFusedOps):
            module.fused_ops = ops


@runtime_checkable
class _UsesFusedOps(Protocol):
    """A layer with a ``fused_ops`` attribute (the check is ``hasattr``)."""

    fused_ops: FusedOps
