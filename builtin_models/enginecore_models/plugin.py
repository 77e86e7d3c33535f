"""Registers the torch model runner and the built-in model architectures.

Lazy ``module:Class`` strings keep ``import enginecore`` free of torch: the classes are
imported only in the worker that runs them.
"""

from __future__ import annotations

from typing import Any

import enginecore

_MODELS = "enginecore_models.models"


@enginecore.hookimpl(trylast=True)
def register_model_runners(registry: Any) -> None:
    registry.add(
        "torch",
        "enginecore_models.model_runner:TorchModelRunner",
        summary="PyTorch runner with paged attention (CPU and CUDA)",
    )
    registry.add(
        "pooling",
        "enginecore_models.pooling_runner:PoolingModelRunner",
        summary="embeddings: decoder embedders (last/mean/CLS pooling) and BERT encoders",
    )


# architecture -> (module:Class, summary, features). The built-in models shard over
# tensor- and pipeline-parallel ranks (GPT-2: tensor only); "gguf": the GGUF loader
# maps its tensors.
_PARALLEL = ("tp", "pp")
_BUILTIN_MODELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "LlamaForCausalLM": ("llama:LlamaForCausalLM", "Llama 2/3 family", ("gguf", *_PARALLEL)),
    "MistralForCausalLM": (
        "llama:LlamaForCausalLM",
        "Mistral (sliding-window attention)",
        ("sliding_window", "gguf", *_PARALLEL),
    ),
    "Qwen2ForCausalLM": (
        "llama:LlamaForCausalLM",
        "Qwen2 (QKV bias, sliding window)",
        ("sliding_window", "gguf", *_PARALLEL),
    ),
    "Qwen3ForCausalLM": (
        "qwen3:Qwen3ForCausalLM",
        "Qwen3 (QK norm)",
        ("sliding_window", "gguf", *_PARALLEL),
    ),
    "Qwen3MoeForCausalLM": (
        "qwen3_moe:Qwen3MoeForCausalLM",
        "Qwen3-MoE (QK norm, mixture of experts)",
        ("sliding_window", "moe", "gguf", *_PARALLEL),
    ),
    "Qwen2MoeForCausalLM": (
        "qwen2_moe:Qwen2MoeForCausalLM",
        "Qwen2-MoE (mixture of experts with a shared expert)",
        ("sliding_window", "moe", *_PARALLEL),
    ),
    "MixtralForCausalLM": (
        "mixtral:MixtralForCausalLM",
        "Mixtral (mixture of experts, sliding window)",
        ("sliding_window", "moe", *_PARALLEL),
    ),
    "GemmaForCausalLM": (
        "gemma2:GemmaForCausalLM",
        "Gemma (GELU-tanh, scaled embeddings)",
        _PARALLEL,
    ),
    "Gemma2ForCausalLM": (
        "gemma2:GemmaForCausalLM",
        "Gemma 2 (soft-capping, alternating sliding and global layers)",
        ("sliding_window", "gguf", *_PARALLEL),
    ),
    "Gemma3ForCausalLM": (
        "gemma2:GemmaForCausalLM",
        "Gemma 3 text (QK norm, local and global RoPE)",
        ("sliding_window", "gguf", *_PARALLEL),
    ),
    "Phi3ForCausalLM": (
        "phi3:Phi3ForCausalLM",
        "Phi-3 (fused QKV and gate/up, LongRoPE)",
        ("sliding_window", "gguf", *_PARALLEL),
    ),
    "Olmo2ForCausalLM": (
        "olmo2:Olmo2ForCausalLM",
        "OLMo 2 (post-norm blocks, QK norm)",
        _PARALLEL,
    ),
    "GPT2LMHeadModel": ("gpt2:GPT2LMHeadModel", "GPT-2", ("tp",)),
    "BertModel": ("bert:BertModel", "BERT encoder (pooling runner only)", ("encoder",)),
}


@enginecore.hookimpl(trylast=True)
def register_models(registry: Any) -> None:
    for name, (ref, summary, features) in _BUILTIN_MODELS.items():
        registry.add(name, f"{_MODELS}.{ref}", summary=summary, features=features)


@enginecore.hookimpl(trylast=True)
def register_linear_methods(registry: Any) -> None:
    registry.add(
        "unquantized",
        "enginecore.layers.linear:UnquantizedLinearMethod",
        summary="weights in the model's dtype, multiplied by F.linear (any device)",
    )


@enginecore.hookimpl(trylast=True)
def register_spec_decode_proposers(registry: Any) -> None:
    registry.add(
        "ngram",
        "enginecore_models.ngram_proposer:NgramProposer",
        summary="prompt lookup: continue the latest earlier match of the text's suffix",
    )
