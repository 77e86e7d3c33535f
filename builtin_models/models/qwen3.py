"""Qwen3: the Llama block with an RMS norm over each query and key head (QK norm)."""

from __future__ import annotations

from typing import Any

import torch

from enginecore.builtin_models.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from enginecore.distributed import ParallelContext
from enginecore.layers import AttentionContext, RMSNorm, RotaryEmbedding


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        is_qwen2: bool,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(cfg, parallel, dtype, is_qwen2, sliding_window)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = self.q_norm(qkv[:, :q_size].reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, q_size : q_size + kv_size].reshape(t, -1, self.head_dim))
        qk = rotary(positions, torch.cat((q, k), dim=1))  # one rotation for both
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, ctx)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
