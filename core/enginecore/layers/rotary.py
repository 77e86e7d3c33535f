"""Rotary position embedding and the RoPE scaling variants checkpoints carry.

Every variant reduces to a table of rotation frequencies per position (plus, for yarn and
longrope, a factor applied to cos and sin). The table is computed once at load time, so
the forward pass is the same gather-and-rotate whatever the variant:

- ``default``: ``theta ** (-2i / d)``.
- ``linear``: positions divided by ``factor``.
- ``llama3``: long wavelengths slowed by ``factor``, short ones kept, a smooth band between.
- ``yarn``: per-dimension blend of interpolated and original frequencies, cos/sin scaled.
- ``dynamic`` (NTK): frequencies of the original model up to ``max_position_embeddings``;
  beyond, the base grows with the sequence length. Each position uses the frequencies of a
  sequence ending at it (transformers recomputes them per forward pass for the longest
  sequence; both agree for positions inside the original length).
- ``longrope`` (Phi-3): ``short_factor`` below ``original_max_position_embeddings``,
  ``long_factor`` from there on, cos/sin scaled by the attention factor.
- partial rotary (``partial_rotary_factor`` < 1): only the first part of each head turns.
- ``freq_factors`` (GGUF files carry Llama 3's scaling as a ``rope_freqs`` tensor): each
  frequency divided by its factor.

Any other ``rope_type`` is refused at load with its name (``UnsupportedModelError``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from enginecore.errors import UnsupportedModelError
from enginecore.layers.fused_ops import NO_FUSED_OPS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Rope settings from a config of any transformers version.

    transformers 5 keeps ``rope_theta`` and the scaling in ``rope_parameters`` (per layer
    type for models whose local and global layers differ, as Gemma 3's); older versions
    use ``rope_theta`` and ``rope_scaling``. ``layer_type`` picks one of the per-type sets.
    """
    params: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, name, None)
        if isinstance(value, dict):
            if layer_type is not None and isinstance(value.get(layer_type), dict):
                value = value[layer_type]
            elif any(isinstance(v, dict) for v in value.values()):
                value = value.get("full_attention", {})
            params.update(value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type or "default"
    if "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", 1.0)
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        if params.get(key) is None and getattr(hf_config, key, None) is not None:
            params[key] = getattr(hf_config, key)
    check_rope_type(params)
    return params


def check_rope_type(params: dict[str, Any]) -> None:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many of a head's dimensions rotate (all but with partial rotary)."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def _base_inv_freq(rot_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    return 1.0 / (base**exponents)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rot_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    old_len = params.get("original_max_position_embeddings") or params["max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / old_len
    factor = float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rot_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _base_inv_freq(rot_dim, base)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # where the original frequency is kept
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def position_frequencies(
    rot_dim: int, max_positions: int, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """``(angles [max_positions, rot_dim / 2], cos/sin factor)``: the rotation angle of each
    position and frequency."""
    check_rope_type(params)
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq = _base_inv_freq(rot_dim, base)
    factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq, factor = _yarn(rot_dim, params)
    elif rope_type == "dynamic":
        return _dynamic_angles(rot_dim, positions, params), factor
    elif rope_type == "longrope":
        return _longrope_angles(rot_dim, positions, params)
    if params.get("freq_factors") is not None:
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return torch.outer(positions, inv_freq), factor


def _dynamic_angles(rot_dim: int, positions: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    base, factor = float(params["rope_theta"]), float(params["factor"])
    max_len = float(params["max_position_embeddings"])
    seq_len = torch.clamp(positions + 1, min=max_len)[:, None]  # a sequence ending here
    grown = base * ((factor * seq_len / max_len) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float()[None, :] / rot_dim
    return positions[:, None] / grown**exponents


def _longrope_angles(
    rot_dim: int, positions: torch.Tensor, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    old_len = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or params["max_position_embeddings"] / old_len
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    inv = _base_inv_freq(rot_dim, base)
    short = inv / torch.tensor(params["short_factor"], dtype=torch.float32)
    long = inv / torch.tensor(params["long_factor"], dtype=torch.float32)
    beyond = (positions >= old_len)[:, None]
    return positions[:, None] * torch.where(beyond, long, short), float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves), cos/sin precomputed per position.

    Every layer of a step rotates at the same positions, so the step's cos/sin rows are
    gathered once and reused (keyed on the positions tensor itself). With partial rotary
    only the first ``rot_dim`` dimensions of each head turn.
    """

    cos: torch.Tensor  # registered buffers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = rotary_dim(head_dim, params)
        angles, factor = position_frequencies(self.rot_dim, max_positions, params)
        cos, sin = angles.cos() * factor, angles.sin() * factor
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
        partial = self.rot_dim != self.head_dim
        if not partial:
            out = self.fused_ops.rotary_(x, positions, self.cos, self.sin)
            if out is not None:
                return out
        cos, sin = self._tables(positions)
        turning = x[..., : self.rot_dim] if partial else x
        xf = turning.float()
        half = self.rot_dim // 2
        swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        rotated = (xf * cos + swapped * sin).to(x.dtype)
        if not partial:
            return rotated
        return torch.cat((rotated, x[..., self.rot_dim :]), dim=-1)
