"""Parameters of the core layers and how checkpoint tensors are copied into them.

Parameters are created with ``torch.empty`` (no random init): every one is overwritten by
``load_weights``, and skipping init makes building a model nearly free. Each carries a
``weight_loader(param, tensor[, shard])`` that copies this rank's part of the full
checkpoint tensor, so checkpoints stay in the ordinary unsharded HF layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from enginecore.errors import EngineCoreError

logger = logging.getLogger(__name__)


class MissingWeightsError(EngineCoreError, ValueError):
    """The checkpoint lacks tensors the model needs."""


def make_param(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (``weight_loader``, ``num_shards``) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def load_params(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], tuple[str, Any] | None],
    stacked: dict[str, tuple[str, Any]] | None = None,
) -> None:
    """Copy checkpoint tensors into ``model``'s parameters.

    ``stacked`` (checkpoint projection -> (fused parameter, shard)) lets a missing shard
    be reported under the checkpoint's own tensor name.

    ``rename(ckpt_name)`` returns ``(param_name, shard)`` (shard: None, or the part of a
    fused parameter), or None to skip the tensor. Raises :class:`MissingWeightsError`
    naming every parameter (or fused shard) the checkpoint did not provide.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[Any]] = {}
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        target = rename(ckpt_name)
        if target is None:
            continue
        name, shard = target
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        loaded.setdefault(name, set()).add(shard)
    if unexpected:
        logger.warning(
            "ignored %d checkpoint tensors the model has no parameter for: %s",
            len(unexpected),
            ", ".join(unexpected[:10]),
        )
    missing = []
    for name, param in params.items():
        shards = loaded.get(name)
        if shards is None:
            missing.append(name)
        elif len(shards - {None}) < getattr(param, "num_shards", 0) and None not in shards:
            expected = {
                shard: ckpt
                for ckpt, (fused, shard) in (stacked or {}).items()
                if f".{fused}." in f".{name}"
            }
            absent = [ckpt for shard, ckpt in expected.items() if shard not in shards]
            if absent:
                assert stacked is not None  # expected came from its entries
                for ckpt in absent:
                    fused = stacked[ckpt][0]
                    missing.append(name.replace(f".{fused}.", f".{ckpt}."))
            else:
                missing.append(f"{name} (only shards {sorted(map(str, shards))})")
    if missing:
        raise MissingWeightsError(
            f"checkpoint is missing {len(missing)} weight tensor(s) for "
            f"{type(model).__name__}: {', '.join(missing)}"
        )
