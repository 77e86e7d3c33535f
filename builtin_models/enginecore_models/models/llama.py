"""The Llama family: Llama, Mistral and Qwen2 (same block; Qwen2 adds a QKV bias)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from enginecore.distributed import SINGLE_RANK, ParallelContext
from enginecore.layers import (
    Attention,
    AttentionContext,
    MergedColumnParallelLinear,
    ParallelLMHead,
    PPMissingLayer,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    layer_sliding_windows,
    load_params,
    pp_layer_range,
    rope_parameters,
    vocab_parallel_logits,
)
from enginecore.layers.activation import act_and_mul, get_activation
from enginecore.layers.decode_block import DecodeBlock, declares_block, declares_plain_logits
from enginecore.layers.moe import expert_checkpoint_target


@declares_block(DecodeBlock.LLAMA)
class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        is_qwen2: bool,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=is_qwen2 or bool(getattr(cfg, "attention_bias", False)),
            parallel=parallel,
            dtype=dtype,
        )
        # This rank's share of the heads (all of them at tp_size 1).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            cfg.hidden_size,
            bias=bool(getattr(cfg, "attention_bias", False)) and not is_qwen2,
            parallel=parallel,
            dtype=dtype,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window,
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor, t: int) -> torch.Tensor | None:
        """Q and K ([T, q_size], [T, kv_size]) normalized before rotation, as
        [T, heads + kv_heads, head_dim]; None: no QK norm (Llama)."""
        return None

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
        qk = self.norm_qk(qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], t)
        if qk is None:
            # Q and K heads are adjacent in the fused projection: rotate them in one pass.
            qk = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        qk = rotary(positions, qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, ctx)
        output: torch.Tensor = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        return output


@declares_block(DecodeBlock.LLAMA)
class LlamaMLP(nn.Module):
    """[gate | up] projection, ``act(gate) * up``, down projection (SiLU unless the config
    names another activation)."""

    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
        hidden_act: str | None = None,
    ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [inter, inter],
            bias=bool(getattr(cfg, "mlp_bias", False)),
            parallel=parallel,
            dtype=dtype,
            gated=True,
        )
        self.down_proj = RowParallelLinear(
            inter,
            cfg.hidden_size,
            bias=bool(getattr(cfg, "mlp_bias", False)),
            parallel=parallel,
            dtype=dtype,
        )
        act: str = hidden_act if hidden_act else getattr(cfg, "hidden_act", "silu")
        # Other activations than SiLU take the plain path (the fused kernels apply SiLU).
        self.activation = None if act == "silu" else get_activation(act)
        self.gate_up_proj.gated = self.activation is None
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is not None:
            output: torch.Tensor = self.down_proj(
                act_and_mul(self.activation, self.gate_up_proj(x))
            )
            return output
        fused = self.gate_up_proj.fused_silu_and_mul(x)
        if fused is None:
            fused = self.act_fn(self.gate_up_proj(x))
        output = self.down_proj(fused)
        return output


@declares_block(DecodeBlock.LLAMA)
class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. Architectures with the same block and another attention or MLP
    (Qwen3's QK norm, mixture-of-experts MLPs) override ``attention_cls`` / ``make_mlp``."""

    attention_cls: type[LlamaAttention] = LlamaAttention

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
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = self.attention_cls(cfg, parallel, dtype, is_qwen2, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.mlp = self.make_mlp(cfg, parallel, dtype, layer_index)

    def make_mlp(
        self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype, layer_index: int
    ) -> nn.Module:
        return LlamaMLP(cfg, parallel, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` is the previous layer's MLP output and ``residual`` the stream it
        is added to (None at the first layer: ``hidden`` is the stream). Returns this
        layer's MLP output and its input stream; the caller adds them (fused with the
        next norm)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn = self.self_attn(positions, normed, rotary, kv_cache, ctx)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(normed), residual


@declares_block(DecodeBlock.LLAMA)
class LlamaModel(nn.Module):
    """The decoder stack. Under pipeline parallelism a stage holds only its layers (the
    others are parameter-free placeholders, so parameter names stay global), the first
    stage the embedding and the last stage the final norm."""

    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(
        self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype, is_qwen2: bool
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.start_layer, self.end_layer = pp_layer_range(cfg.num_hidden_layers, parallel)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if parallel.is_first_pp_rank:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, parallel=parallel, dtype=dtype
            )
        windows = layer_sliding_windows(cfg)  # Mistral / Qwen2 sliding-window attention
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, parallel, dtype, is_qwen2, windows[i], i)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        # An RMSNorm here; a model whose stack ends in another norm replaces it (and forward).
        self.norm: nn.Module | None = None
        if parallel.is_last_pp_rank:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        first = cast(LlamaDecoderLayer, self.layers[self.start_layer])
        self.rotary = RotaryEmbedding(
            first.self_attn.head_dim, cfg.max_position_embeddings, rope_parameters(cfg)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        ctx: AttentionContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` is the previous stage's output (pipeline stages after the
        first); returns the final normed hidden states, or this stage's output."""
        if hidden_states is None:
            hidden: torch.Tensor = self.first_stage_embedding()(input_ids)
        else:  # the fused add + norm updates the stream in place: not the caller's tensor
            hidden = hidden_states.clone()
        residual = None
        for i in range(self.start_layer, self.end_layer):
            cache = kv_caches[i - self.start_layer] if kv_caches else None
            layer_out: tuple[torch.Tensor, torch.Tensor] = self.layers[i](
                positions, hidden, residual, self.rotary, cache, ctx
            )
            hidden, residual = layer_out
        if residual is None:  # a stage without layers
            if self.norm is None:
                return hidden
            normed: torch.Tensor = self.norm(hidden)
            return normed
        if self.norm is None:
            return residual + hidden
        norm = self.norm
        assert isinstance(norm, RMSNorm)  # a model with another norm has its own forward
        return norm.add_and_norm(hidden, residual)[0]

    def first_stage_embedding(self) -> VocabParallelEmbedding:
        """The token embedding, which only the first pipeline stage holds."""
        if self.embed_tokens is None:
            raise RuntimeError("only the first pipeline stage embeds tokens")
        return self.embed_tokens


@declares_block(DecodeBlock.LLAMA)
@declares_plain_logits
class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints;
    subclasses with the same stack and another block set ``model_cls``."""

    model_cls: type[LlamaModel] = LlamaModel

    # checkpoint projection name -> (fused parameter name, shard)
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
        # Qwen2: biased q/k/v, unbiased o_proj; Llama/Mistral: attention_bias for all four.
        is_qwen2 = self.bias_on_qkv_only(hf_config)
        self.model = self.model_cls(hf_config, parallel, dtype, is_qwen2)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # A tied head reuses the embedding, unless that lives on another pipeline stage.
        self.lm_head = None
        if parallel.is_last_pp_rank and not (
            self.tie_word_embeddings and parallel.is_first_pp_rank
        ):
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, parallel=parallel, dtype=dtype
            )

    @staticmethod
    def bias_on_qkv_only(hf_config: Any) -> bool:
        """Qwen2's layout: biased q/k/v and an unbiased o_proj."""
        return getattr(hf_config, "model_type", "") == "qwen2"

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this model's parameters spell it."""
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_context: AttentionContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        output: torch.Tensor = self.model(
            input_ids, positions, kv_caches, attn_context, hidden_states
        )
        return output

    def logits_head(self) -> VocabParallelEmbedding:
        """The weight that computes logits: the LM head, or the embedding it is tied to."""
        return self.model.first_stage_embedding() if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden_states, self.logits_head())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = set(dict(self.named_parameters()))
        pp = self.parallel.pp_size > 1

        def rename(name: str) -> tuple[str, Any] | None:
            name = self.checkpoint_name(name)
            if "rotary_emb" in name:
                return None
            expert = expert_checkpoint_target(name)  # mixture-of-experts weights
            if expert is not None:
                return None if pp and expert[0] not in params else expert
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the embedding is loaded under its own name
            if (
                name == "model.embed_tokens.weight"
                and self.tie_word_embeddings
                and self.model.embed_tokens is None
                and self.lm_head is not None
            ):
                return "lm_head.weight", None  # tied head on the last pipeline stage
            for ckpt, (fused, shard) in self.stacked_params.items():
                if f".{ckpt}." in name:
                    name, target = name.replace(f".{ckpt}.", f".{fused}."), shard
                    break
            else:
                target = None
            if pp and name not in params:
                return None  # lives on another pipeline stage
            return name, target

        load_params(self, weights, rename, self.stacked_params)
