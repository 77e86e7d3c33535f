"""MLP activations, by the names checkpoints give in ``hidden_act`` /
``hidden_activation`` (transformers' ``ACT2FN``; an unknown one is refused at load with
its name), and the gated ``act(gate) * up``; ``silu(gate) * up`` may run as a backend's
fused kernel (:class:`SiluAndMul`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.errors import UnsupportedModelError
from enginecore.layers.fused_ops import NO_FUSED_OPS

Activation = Callable[[torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


def get_activation(name: str) -> Activation:
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise UnsupportedModelError(
            f"activation {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})"
        )
    return fn


def act_and_mul(activation: Activation, gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of a fused [gate | up] projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate).mul_(up)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``x`` = [gate | up] (the last dimension split in halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_ops = NO_FUSED_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fused_ops.silu_and_mul(x)
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one fewer temporary
