"""Rotary position embedding, with the ``rope_scaling`` variants checkpoints carry."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from enginecore.layers.fused_ops import NO_FUSED_OPS


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """Rope settings from a config of any transformers version.

    transformers 5 keeps ``rope_theta`` and the scaling in ``rope_parameters``; older
    versions use ``rope_theta`` and ``rope_scaling``.
    """
    params: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, name, None)
        if isinstance(value, dict):
            params.update(value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type or "default"
    return params


def _inv_freq(rot_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, a smooth band between.
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves), cos/sin precomputed per position.

    Every layer of a step rotates at the same positions, so the step's cos/sin rows are
    gathered once and reused (keyed on the positions tensor itself).
    """

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # float32 even for bf16 models: positions are large and the reference keeps fp32.
        # Laid out for ``x * cos + swap_halves(x) * sin``: [cos, cos] and [-sin, sin].
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.fused_ops = NO_FUSED_OPS

    def forget_step(self) -> None:
        """Drop the step's cached rows (before capturing a CUDA graph, whose positions
        tensor is reused across replays)."""
        self._step = None

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        if step is None or step[0] is not positions:
            cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
            sin = self.sin.index_select(0, positions).unsqueeze(1)
            step = self._step = (positions, cos, sin)
        return step[1], step[2]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (query and key heads side by side, so one call rotates both) ->
        rotated: in place by a fused kernel, else a copy. The products and the sum are
        rounded as the reference's ``q * cos + rotate_half(q) * sin``."""
        out = self.fused_ops.rotary_(x, positions, self.cos, self.sin)
        if out is not None:
            return out
        cos, sin = self._tables(positions)
        xf = x.float()
        half = self.head_dim // 2
        swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + swapped * sin).to(x.dtype)
