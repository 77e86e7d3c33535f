"""Sliding-window attention: which layers have a window, and the mask that applies it.

Convention (transformers' ``sliding_window_overlay``): a query at absolute position ``q``
sees key ``k`` iff ``q - window < k <= q``, i.e. the last ``window`` positions including
its own. Mistral applies ``config.sliding_window`` to every layer; Qwen2 (and any config
with ``layer_types``) only to the layers marked ``"sliding_attention"`` (for Qwen2,
``use_sliding_window`` and layers ``>= max_window_layers``).

The paged cache still holds every position (prefix caching and preemption stay as they
are); the window is a mask over the gathered keys.
"""

from __future__ import annotations

from typing import Any

import torch

from enginecore.errors import ConfigError


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """The attention window of each layer (None: full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", None) is False:
        window = None  # the Qwen configs carry a sliding_window they ignore unless enabled
    if window is None or window == 0:  # Qwen2-MoE writes 0 for "no window"
        return [None] * num_layers
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(
            f"config.json: layer_types {unknown} are not supported "
            "(only 'sliding_attention' and 'full_attention')"
        )
    return [window if t == "sliding_attention" else None for t in layer_types]


def restrict_to_window(mask: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [R, 1, Q, K] (True = attend) narrowed to keys ``k > q_pos - window``.

    ``q_pos`` is [R, Q], the absolute position of each query row. A padded query row
    whose keys all fall outside keeps key 0 (SDPA gives NaN for a fully masked row; the
    padded rows' outputs are dropped anyway)."""
    k_idx = torch.arange(mask.shape[-1], device=mask.device)
    inside = k_idx[None, None, :] > (q_pos[:, :, None] - window)  # [R, Q, K]
    windowed = mask & inside.unsqueeze(1)
    empty = ~windowed.any(dim=-1, keepdim=True)
    return windowed | (empty & (k_idx == 0))


def decode_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """[R, 1, 1, kv_len] bool, True = attend, for one query per row at ``q_pos`` [R, 1]:
    keys up to its own position, the last ``window`` of them when given."""
    k_idx = torch.arange(kv_len, device=q_pos.device)
    mask = (k_idx[None, :] <= q_pos)[:, None, None, :]
    return mask if window is None else restrict_to_window(mask, q_pos, window)
