"""The decoder blocks a backend's fused decode step may compute, as models declare them.

A backend that runs a whole decode step in one foreign call (the ``cpu`` backend's
``fused_decode``) must know the block's exact computation. It learns it from what the
model's own classes declare here, never by naming a model class: a model plugin decorates
its causal LM (whose ``forward`` is its stack's and nothing more), stack, decoder layer,
attention and MLP classes with :func:`declares_block`. The declaration belongs to the
decorated class only; a subclass that changes the computation (a plugin's model that
overrides ``forward``) declares nothing unless it says so again, so its own code runs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

_Class = TypeVar("_Class", bound=type)


class DecodeBlock(enum.Enum):
    """Pre-norm RMSNorm blocks with fused QKV and gate-up projections, rotary over every
    head dimension and a SiLU-gated MLP (Llama, Mistral, Qwen2); ``LLAMA_QK_NORM`` adds an
    RMS norm over each query and key head (Qwen3)."""

    LLAMA = "llama"
    LLAMA_QK_NORM = "llama_qk_norm"


_DECLARED: dict[type, DecodeBlock] = {}


def declares_block(block: DecodeBlock) -> Callable[[_Class], _Class]:
    """Class decorator: instances of exactly this class compute ``block``'s part."""

    def declare(cls: _Class) -> _Class:
        _DECLARED[cls] = block
        return cls

    return declare


def declared_block(module: object) -> DecodeBlock | None:
    """The block ``module``'s own class declares, or None."""
    return _DECLARED.get(type(module))


_PLAIN_HEADS: set[type] = set()


def declares_plain_logits(cls: _Class) -> _Class:
    """Class decorator for a causal LM: its ``compute_logits(hidden)`` is the product of
    the final hidden states with ``logits_head()``'s weight under its linear method, and
    nothing more (no scaling, soft-cap or bias), so a fused decode step may compute it.
    Exactly this class, as :func:`declares_block`."""
    _PLAIN_HEADS.add(cls)
    return cls


def declares_logits_head(model: object) -> bool:
    """Whether ``model``'s own class declared :func:`declares_plain_logits`."""
    return type(model) in _PLAIN_HEADS
