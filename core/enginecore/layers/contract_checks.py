"""Cheap checks that a plugin's attention backend and linear method return what the
model expects: the output's shape and dtype, once per new input shape per layer.

A wrong shape would otherwise surface as an unrelated error several ops later (or as
silently wrong tokens when it happens to broadcast); here it is a
:class:`enginecore.errors.PluginContractError` naming the component's class and method, which the engine
maps to the plugin that registered it.
"""

from __future__ import annotations

from typing import Any

import torch

from enginecore.errors import PluginContractError


def _first_time(layer: Any, key: tuple[Any, ...]) -> bool:
    """True the first time ``layer`` sees ``key`` (input shape and dtype)."""
    try:
        seen: set[tuple[Any, ...]] = layer.__dict__["_contract_checked"]
    except KeyError:
        seen = layer.__dict__["_contract_checked"] = set()
    if key in seen:
        return False
    seen.add(key)
    return True


def check_attention_output(backend: Any, layer: Any, query: torch.Tensor, out: Any) -> None:
    """``backend.forward`` must return ``[T, num_heads, head_dim]`` in the query's dtype."""
    if not _first_time(layer, (query.shape, query.dtype)):
        return
    if (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != tuple(query.shape)
        or out.dtype != query.dtype
    ):
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(out)
        seen: set[Any] = layer.__dict__["_contract_checked"]
        seen.discard((query.shape, query.dtype))  # check again: it is still wrong
        method = type(backend).forward
        raise PluginContractError(
            f"attention backend {type(backend).__qualname__}.forward returned {got} for a "
            f"query of {tuple(query.shape)} {query.dtype}; it must return the query's shape "
            "[tokens, heads, head_dim] and dtype",
            origin=method,
        )


def check_linear_output(layer: Any, x: torch.Tensor, out: Any) -> None:
    """``linear_method.apply`` must return ``[*x.shape[:-1], output_size]`` in x's dtype."""
    if not _first_time(layer, (x.shape, x.dtype)):
        return
    expected = (*x.shape[:-1], layer.output_size)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != x.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(out)
        layer.__dict__["_contract_checked"].discard((x.shape, x.dtype))
        method = type(layer.linear_method)
        raise PluginContractError(
            f"linear method {method.__qualname__}.apply returned {got} for an input of "
            f"{tuple(x.shape)} {x.dtype} on a layer of output size {layer.output_size}; "
            f"it must return {expected} in the input's dtype",
            origin=method.apply,
        )
