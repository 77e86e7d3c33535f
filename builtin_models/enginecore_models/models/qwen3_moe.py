"""Qwen3-MoE: Qwen3's attention (QK norm) with a mixture-of-experts MLP on the layers
``decoder_sparse_step`` selects (a dense MLP on ``mlp_only_layers``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from enginecore.distributed import ParallelContext
from enginecore.layers.moe import SparseMoeBlock
from enginecore_models.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from enginecore_models.models.qwen3 import Qwen3DecoderLayer


def is_sparse_layer(cfg: Any, layer_index: int) -> bool:
    """transformers' rule for Qwen2-MoE and Qwen3-MoE."""
    return (
        layer_index not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (layer_index + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
    )


def qwen_moe_block(cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> SparseMoeBlock:
    return SparseMoeBlock(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        parallel=parallel,
        dtype=dtype,
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(
        self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype, layer_index: int
    ) -> nn.Module:
        if is_sparse_layer(cfg, layer_index):
            return qwen_moe_block(cfg, parallel, dtype)
        return LlamaMLP(cfg, parallel, dtype)


class Qwen3MoeModel(LlamaModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel
