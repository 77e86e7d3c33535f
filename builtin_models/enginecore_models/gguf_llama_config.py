"""Llama's config for a GGUF file, without transformers' Llama config module.

``transformers.models.llama.configuration_llama`` imports transformers' field validators,
which import its activations and, through them, its model-loading stack
(``torch.distributed``, accelerate): most of a GGUF load's start for one validator. A
Llama config is plain fields, so it is built on transformers' base config class with the
``model_type`` and the defaults of ``LlamaConfig``: the same ``to_dict()``, read back by
``AutoConfig`` as a ``LlamaConfig``.
"""

from __future__ import annotations

from typing import Any

from transformers.configuration_utils import PreTrainedConfig

# LlamaConfig's defaults for the fields a GGUF file does not carry.
LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
}


class GGUFLlamaConfig(PreTrainedConfig):
    """A Llama model's config, read from a GGUF file's metadata."""

    model_type = "llama"


def gguf_llama_config(**kwargs: Any) -> GGUFLlamaConfig:
    """``LlamaConfig(**kwargs)``, on the base class: LlamaConfig's defaults under ``kwargs``."""
    config = GGUFLlamaConfig(**{**LLAMA_DEFAULTS, **kwargs})
    # The base class takes ``use_cache`` for a generation setting and drops it; LlamaConfig
    # declares it as a field.
    config.use_cache = True
    return config
