"""Registers the torch model runner and the built-in model architectures.

Lazy ``module:Class`` strings keep ``import enginecore`` free of torch: the classes are
imported only in the worker that runs them.
"""

from __future__ import annotations

from typing import Any

import enginecore

_MODELS = "enginecore.builtin_models.models"


@enginecore.hookimpl(trylast=True)
def register_model_runners(registry: Any) -> None:
    registry.add(
        "torch",
        "enginecore.builtin_models.model_runner:TorchModelRunner",
        summary="PyTorch runner with paged attention (CPU and CUDA)",
    )


@enginecore.hookimpl(trylast=True)
def register_models(registry: Any) -> None:
    llama = f"{_MODELS}.llama:LlamaForCausalLM"
    registry.add("LlamaForCausalLM", llama, summary="Llama 2/3 family")
    registry.add("MistralForCausalLM", llama, summary="Mistral (sliding-window attention)")
    registry.add("Qwen2ForCausalLM", llama, summary="Qwen2 (QKV bias, sliding window)")
    registry.add("GPT2LMHeadModel", f"{_MODELS}.gpt2:GPT2LMHeadModel", summary="GPT-2")
    registry.add("Qwen3ForCausalLM", f"{_MODELS}.qwen3:Qwen3ForCausalLM", summary="Qwen3 (QK norm)")
    registry.add(
        "Qwen3MoeForCausalLM",
        f"{_MODELS}.qwen3_moe:Qwen3MoeForCausalLM",
        summary="Qwen3-MoE (QK norm, mixture of experts)",
    )
    registry.add(
        "Qwen2MoeForCausalLM",
        f"{_MODELS}.qwen2_moe:Qwen2MoeForCausalLM",
        summary="Qwen2-MoE (mixture of experts with a shared expert)",
    )
    gemma = f"{_MODELS}.gemma2:GemmaForCausalLM"
    registry.add("GemmaForCausalLM", gemma, summary="Gemma (GELU-tanh, scaled embeddings)")
    registry.add(
        "Gemma2ForCausalLM",
        gemma,
        summary="Gemma 2 (soft-capping, alternating sliding and global layers)",
    )
    registry.add(
        "Gemma3ForCausalLM", gemma, summary="Gemma 3 text (QK norm, local and global RoPE)"
    )
    registry.add(
        "Phi3ForCausalLM",
        f"{_MODELS}.phi3:Phi3ForCausalLM",
        summary="Phi-3 (fused QKV and gate/up, LongRoPE)",
    )
    registry.add(
        "Olmo2ForCausalLM",
        f"{_MODELS}.olmo2:Olmo2ForCausalLM",
        summary="OLMo 2 (post-norm blocks, QK norm)",
    )
    registry.add(
        "MixtralForCausalLM",
        f"{_MODELS}.mixtral:MixtralForCausalLM",
        summary="Mixtral (mixture of experts, sliding window)",
    )


@enginecore.hookimpl(trylast=True)
def register_spec_decode_proposers(registry: Any) -> None:
    registry.add(
        "ngram",
        "enginecore.builtin_models.ngram_proposer:NgramProposer",
        summary="prompt lookup: continue the latest earlier match of the text's suffix",
    )
