"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text).

What sets them apart from Llama: the embedding is scaled by ``sqrt(hidden_size)``; the RMS
norms multiply by ``1 + weight``; the MLP uses GELU-tanh; Gemma 2/3 add a norm after the
attention and after the MLP, alternate sliding-window and global layers, and scale
queries by ``query_pre_attn_scalar``. Gemma 2 soft-caps the attention scores and the
final logits; Gemma 3 normalises each query and key head (QK norm) and gives its sliding
layers their own RoPE base.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import SINGLE_RANK, ParallelContext
from enginecore.layers import (
    Attention,
    AttentionContext,
    ParallelLMHead,
    PPMissingLayer,
    RotaryEmbedding,
    VocabParallelEmbedding,
    default_weight_loader,
    layer_sliding_windows,
    load_params,
    pp_layer_range,
    rope_parameters,
    vocab_parallel_logits,
)
from enginecore.layers.weights import set_weight_attrs
from enginecore_models.models.llama import LlamaAttention, LlamaMLP

_SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """RMS norm scaled by ``1 + weight``, all in float32, rounded once at the end."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        sliding_window: int | None,
    ) -> None:
        super().__init__(cfg, parallel, dtype, False, sliding_window)
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        scale = float(scalar) ** -0.5 if scalar is not None else self.head_dim**-0.5
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale,
            self.num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=getattr(cfg, "attn_logit_softcapping", None),
        )
        self.qk_norm = getattr(cfg, "model_type", "") == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor, t: int) -> torch.Tensor | None:
        if not self.qk_norm:  # Gemma 1 and 2
            return None
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        return torch.cat((q, k), dim=1)


def _activation(cfg: Any) -> str:
    name = getattr(cfg, "hidden_activation", None)
    fallback: str = getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
    return str(name) if name else fallback


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        sliding_window: int | None,
        sandwich_norms: bool,
    ) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps, dtype)
        self.self_attn = GemmaAttention(cfg, parallel, dtype, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps, dtype)
        self.mlp = LlamaMLP(cfg, parallel, dtype, hidden_act=_activation(cfg))
        # Gemma 2/3 norm the attention and MLP outputs too ("sandwich" norms).
        self.sandwich_norms = sandwich_norms
        if sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps, dtype)
            self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary, kv_cache, ctx)
        if not self.sandwich_norms:  # Gemma: the Llama block
            hidden = hidden + attn
            output: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
            return output
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        output = hidden + self.post_feedforward_layernorm(mlp)
        return output


class GemmaModel(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.start_layer, self.end_layer = pp_layer_range(cfg.num_hidden_layers, parallel)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if parallel.is_first_pp_rank:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, parallel=parallel, dtype=dtype
            )
        # The reference rounds the scale to the model's dtype before multiplying.
        self.normalizer = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))
        sandwich = getattr(cfg, "model_type", "") != "gemma"
        windows = layer_sliding_windows(cfg)
        self.layer_types = [_SLIDING if w is not None else "full_attention" for w in windows]
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, parallel, dtype, windows[i], sandwich)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = None
        if parallel.is_last_pp_rank:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        head_dim = cast(GemmaDecoderLayer, self.layers[self.start_layer]).self_attn.head_dim
        # Gemma 3 gives its sliding layers another RoPE base than its global ones.
        self.rotaries = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, cfg.max_position_embeddings, _layer_rope(cfg, kind))
                for kind in sorted(set(self.layer_types))
            }
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        ctx: AttentionContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if hidden_states is None:
            hidden: torch.Tensor = self.first_stage_embedding()(input_ids) * self.normalizer
        else:
            hidden = hidden_states
        for i in range(self.start_layer, self.end_layer):
            cache = kv_caches[i - self.start_layer] if kv_caches else None
            rotary = self.rotaries[self.layer_types[i]]
            hidden = self.layers[i](positions, hidden, rotary, cache, ctx)
        return hidden if self.norm is None else self.norm(hidden)

    def first_stage_embedding(self) -> VocabParallelEmbedding:
        """The token embedding, which only the first pipeline stage holds."""
        if self.embed_tokens is None:
            raise RuntimeError("only the first pipeline stage embeds tokens")
        return self.embed_tokens


def _layer_rope(cfg: Any, layer_type: str) -> dict[str, Any]:
    params = rope_parameters(cfg, layer_type)
    per_type = isinstance(getattr(cfg, "rope_parameters", None), dict) and any(
        isinstance(v, dict) for v in cfg.rope_parameters.values()
    )
    local_base = getattr(cfg, "rope_local_base_freq", None)
    if layer_type == _SLIDING and not per_type and local_base is not None:
        # A transformers-4 Gemma 3 config: local layers use rope_local_base_freq, unscaled.
        params = {**params, "rope_type": "default", "rope_theta": local_base}
    return params


class GemmaForCausalLM(nn.Module):
    """Serves GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM checkpoints."""

    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        hf_config: Any,
        parallel: ParallelContext = SINGLE_RANK,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.parallel = parallel
        self.hidden_size = hf_config.hidden_size
        self.model = GemmaModel(hf_config, parallel, dtype)
        self.final_soft_cap = getattr(hf_config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = None
        if parallel.is_last_pp_rank and not (
            self.tie_word_embeddings and parallel.is_first_pp_rank
        ):
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, parallel=parallel, dtype=dtype
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_metadata: AttentionContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        output: torch.Tensor = self.model(
            input_ids, positions, kv_caches, attn_metadata, hidden_states
        )
        return output

    def logits_head(self) -> VocabParallelEmbedding:
        return self.model.first_stage_embedding() if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = vocab_parallel_logits(hidden_states, self.logits_head())
        if self.final_soft_cap is None:
            return logits
        cap = self.final_soft_cap
        output: torch.Tensor = torch.tanh(logits / cap) * cap
        return output

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = set(dict(self.named_parameters()))
        pp = self.parallel.pp_size > 1

        def rename(name: str) -> tuple[str, Any] | None:
            name = name.removeprefix("language_model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            if (
                name == "model.embed_tokens.weight"
                and self.tie_word_embeddings
                and self.model.embed_tokens is None
                and self.lm_head is not None
            ):
                return "lm_head.weight", None
            target = None
            for ckpt, (fused, shard) in self.stacked_params.items():
                if f".{ckpt}." in name:
                    name, target = name.replace(f".{ckpt}.", f".{fused}."), shard
                    break
            if pp and name not in params:
                return None
            return name, target

        load_params(self, weights, rename, self.stacked_params)
