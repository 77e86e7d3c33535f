"""Mixtral: the Mistral block with a mixture-of-experts MLP (top-k renormalised)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from enginecore.distributed import ParallelContext
from enginecore.layers.moe import SparseMoeBlock
from enginecore_models.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(
        self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype, layer_index: int
    ) -> nn.Module:
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            cfg.intermediate_size,
            renormalize=True,
            hidden_act=getattr(cfg, "hidden_act", "silu"),
            parallel=parallel,
            dtype=dtype,
        )


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def checkpoint_name(self, name: str) -> str:
        # Mixtral checkpoints call the MoE MLP "block_sparse_moe"; transformers 5 "mlp".
        return name.replace(".block_sparse_moe.", ".mlp.")
