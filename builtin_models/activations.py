"""The MLP activations checkpoints name in ``hidden_act`` / ``hidden_activation``.

Names follow transformers' ``ACT2FN``; an unknown one is refused at load with its name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from enginecore.errors import UnsupportedModelError

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
