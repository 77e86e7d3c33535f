"""Building blocks shared by the model architectures.

Linear layers are shaped for tensor parallelism (column-parallel splits the output
dimension, row-parallel the input dimension) and each parameter carries a
``weight_loader`` that copies a full checkpoint tensor into this rank's shard. Only
``tp_size == 1`` is supported today; the shapes and loaders are where TP slots in.

Parameters are created with ``torch.empty`` (no random init): every one is overwritten
by ``load_weights``, and skipping init makes building a model nearly free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import ParallelContext


def _check_tp(parallel: ParallelContext) -> None:
    if parallel.tp_size != 1:
        raise NotImplementedError(
            f"tensor_parallel_size={parallel.tp_size}: the torch runner's models are "
            "TP-shaped but do not shard yet; use tensor_parallel_size=1"
        )


def _param(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split along the output dim across TP ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        _check_tp(parallel)
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = _param((out_features,), dtype)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(ColumnParallelLinear):
    """W split along the input dim; partial outputs are all-reduced (no-op at tp=1)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input fused into one matmul (e.g. gate and up).

    Checkpoints store them separately; ``weight_loader(param, tensor, shard_index)``
    writes each into its rows.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias, parallel=parallel, dtype=dtype)
        self.output_offsets = [0, *list(_cumsum(output_sizes))]
        # load_params checks that every shard of a fused parameter was loaded.
        for p in (self.weight, self.bias):
            if p is not None:
                p.num_shards = len(output_sizes)  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:
            default_weight_loader(param, loaded)
            return
        start, end = self.output_offsets[shard], self.output_offsets[shard + 1]
        default_weight_loader(param.data[start:end], loaded)


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections fused; shards are addressed as "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias=bias, parallel=parallel, dtype=dtype)
        self.q_size, self.kv_size = sizes[0], sizes[1]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
        super().weight_loader(param, loaded, index)


class VocabParallelEmbedding(nn.Module):
    """Token embedding (would be split along the vocabulary across TP ranks)."""

    def __init__(
        self, num_embeddings: int, dim: int, *, parallel: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        _check_tp(parallel)
        self.weight = _param((num_embeddings, dim), dtype)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection (vocab-parallel); may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.linear(hidden, self.weight)


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (as the reference does) and cast back before scaling."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is one fused kernel (the hand-written form is ~50x slower on CPU).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype)
        self.bias = _param((dim,), dtype)
        for p in (self.weight, self.bias):
            p.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


# --- rotary position embedding --------------------------------------------------------


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
        f"rope_type {rope_type!r} is not supported by the torch runner "
        "(supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves), cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # float32 even for bf16 models: positions are large and the reference keeps fp32.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H_q, D], k [T, H_kv, D] -> rotated copies."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)
