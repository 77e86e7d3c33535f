"""OLMo 2: norms after the attention and the MLP (not before), and an RMS norm over the
whole query and key projections (all heads together, unlike Qwen3's per-head norm)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import SINGLE_RANK, ParallelContext
from enginecore.errors import UnsupportedModelError
from enginecore.layers import (
    AttentionContext,
    RotaryEmbedding,
    default_weight_loader,
    tp_all_reduce,
)
from enginecore.layers.weights import set_weight_attrs
from enginecore_models.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


class Olmo2RMSNorm(nn.Module):
    """RMS norm whose weight multiplies in float32 before rounding (the reference's order).

    ``full_dim`` > the local width: the input is this rank's slice of a tensor-parallel
    projection; the mean square is summed over the TP group and the weight is sharded."""

    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
        full_dim: int | None = None,
    ) -> None:
        super().__init__()
        if parallel is None and full_dim not in (None, dim):
            raise ValueError("a norm over a tensor-parallel slice needs its ParallelContext")
        self.eps, self.parallel = eps, parallel or SINGLE_RANK
        self.full_dim = full_dim or dim
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self._load})

    def _load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if self.full_dim != param.shape[0]:
            loaded = loaded.narrow(0, self.parallel.tp_rank * param.shape[0], param.shape[0])
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.full_dim == x.shape[-1]:
            normed = F.rms_norm(xf, (x.shape[-1],), None, self.eps)
        else:
            square_sum = tp_all_reduce(xf.pow(2).sum(-1, keepdim=True), self.parallel)
            normed = xf * torch.rsqrt(square_sum / self.full_dim + self.eps)
        return (self.weight * normed).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        is_qwen2: bool,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(cfg, parallel, dtype, is_qwen2, sliding_window)
        total_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if parallel.tp_size > 1 and total_kv < parallel.tp_size:
            raise UnsupportedModelError(
                f"OLMo 2's key norm spans all {total_kv} KV heads, which cannot be replicated "
                f"over tensor_parallel_size {parallel.tp_size}; use at most {total_kv} ranks"
            )
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        full_q = cfg.num_attention_heads * self.head_dim
        eps = cfg.rms_norm_eps
        self.q_norm = Olmo2RMSNorm(q_size, eps, dtype, parallel, full_q)
        self.k_norm = Olmo2RMSNorm(kv_size, eps, dtype, parallel, total_kv * self.head_dim)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor, t: int) -> torch.Tensor:
        q = self.q_norm(q).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(t, -1, self.head_dim)
        return torch.cat((q, k), dim=1)


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        is_qwen2: bool,
        sliding_window: int | None = None,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Olmo2Attention(cfg, parallel, dtype, is_qwen2, sliding_window)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(cfg, parallel, dtype)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Llama layer's contract (see ``LlamaDecoderLayer.forward``): returns this
        layer's output and the stream it is added to."""
        if residual is not None:
            hidden = residual + hidden
        attn = self.self_attn(positions, hidden, rotary, kv_cache, ctx)
        hidden = hidden + self.post_attention_layernorm(attn)
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2Model(LlamaModel):
    # OLMo 2's layer takes the Llama layer's constructor arguments; it is not a subclass.
    decoder_layer_cls = Olmo2DecoderLayer

    def __init__(
        self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype, is_qwen2: bool
    ) -> None:
        super().__init__(cfg, parallel, dtype, is_qwen2)
        if self.norm is not None:
            self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        ctx: AttentionContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden: torch.Tensor = (
            self.first_stage_embedding()(input_ids) if hidden_states is None else hidden_states
        )
        residual = None
        for i in range(self.start_layer, self.end_layer):
            cache = kv_caches[i - self.start_layer] if kv_caches else None
            layer_out: tuple[torch.Tensor, torch.Tensor] = self.layers[i](
                positions, hidden, residual, self.rotary, cache, ctx
            )
            hidden, residual = layer_out
        if residual is not None:
            hidden = residual + hidden
        return hidden if self.norm is None else self.norm(hidden)


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
