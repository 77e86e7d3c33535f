"""Offline sentence-transformers checkpoints with random weights, for the pooling runner's
tests and benchmarks: a transformers model saved the way sentence-transformers saves it
(``modules.json``, ``1_Pooling/config.json``, optionally ``2_Normalize``), built from
transformers' config classes and sentence-transformers' own modules. Needs
``sentence-transformers`` (the ``test`` extra).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Literal

from enginecore.checkpoints import make_tokenizer

EmbeddingArch = Literal["qwen3", "llama", "bert"]
_ST_POOLING = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def _config(arch: EmbeddingArch, size: str, tokenizer: Any, overrides: dict[str, Any]) -> Any:
    import transformers as tf

    big = size == "small"
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=384 if big else 128,
        num_hidden_layers=6 if big else 2,
        num_attention_heads=6 if big else 4,
        intermediate_size=1536 if big else 256,
        **overrides,
    )
    if arch == "bert":
        return tf.BertConfig(max_position_embeddings=512, **common)
    decoder = dict(
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=64 if big else 32, **decoder, **common)
    if arch == "llama":
        return tf.LlamaConfig(**decoder, **common)
    raise ValueError(f"unknown embedding arch {arch!r}; choose qwen3, llama or bert")


def make_embedding_checkpoint(
    out_dir: str | os.PathLike[str],
    arch: EmbeddingArch = "qwen3",
    pooling: Literal["last", "mean", "cls"] = "last",
    normalize: bool = True,
    *,
    size: Literal["tiny", "small"] = "tiny",
    seed: int = 0,
    causal_lm: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a seeded random-weight sentence-transformers checkpoint to ``out_dir``.

    The transformer is saved head-less (``Qwen3Model``, ``BertModel``: tensors named
    ``layers.0...``, as sentence-transformers saves them), or with ``causal_lm`` as the
    ``*ForCausalLM`` with its LM head (``model.layers.0...``), as decoder embedders such
    as Qwen3-Embedding ship.
    """
    import importlib

    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoModelForCausalLM

    st_models: Any = importlib.import_module("sentence_transformers.models")
    out = pathlib.Path(out_dir)
    tokenizer = make_tokenizer()
    # An embedder's input is the text itself (sentence-transformers would otherwise
    # wrap it in the chat template).
    tokenizer.chat_template = None
    config = _config(arch, size, tokenizer, config_overrides or {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        builder: Any = AutoModelForCausalLM if causal_lm and arch != "bert" else AutoModel
        model = builder.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    transformer = st_models.Transformer(str(out), max_seq_length=config.max_position_embeddings)
    modules: list[Any] = [
        transformer,
        st_models.Pooling(config.hidden_size, pooling_mode=_ST_POOLING[pooling]),
    ]
    if normalize:
        modules.append(st_models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    if causal_lm:  # sentence-transformers re-saved the transformer head-less: put it back
        model.save_pretrained(out, safe_serialization=True)
    return out
