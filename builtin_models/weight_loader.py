"""Read checkpoints: HF directories (config.json + safetensors) and GGUF files.

Both produce the same thing for a model's ``load_weights``: an iterator of
``(hf_name, tensor)`` pairs with HF names and HF layouts. GGUF tensors are de-quantized
at load time, except projections in the block formats a linear method asks for
(``keep_quantized``), which arrive as :class:`QuantizedTensor`; llama.cpp's rope
permutation of Q/K is undone either way.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from enginecore.errors import ConfigError
from enginecore.layers.quantized import QuantizedTensor
from enginecore.layers.weights import MissingWeightsError, load_params
from enginecore.registry import import_ref

logger = logging.getLogger(__name__)


class UnknownArchitectureError(ConfigError):
    """No registered model class serves the checkpoint's architecture."""


# --- configs --------------------------------------------------------------------------


def is_gguf(path: str | pathlib.Path) -> bool:
    return str(path).endswith(".gguf") and pathlib.Path(path).is_file()


def load_hf_config(path: str | pathlib.Path) -> Any:
    """The transformers config of a checkpoint directory or a GGUF file."""
    from transformers import AutoConfig

    p = pathlib.Path(path)
    if is_gguf(p):
        return gguf_hf_config(p)
    if not (p / "config.json").is_file():
        raise ConfigError(f"model path {str(p)!r} has no config.json and is not a .gguf file")
    return AutoConfig.from_pretrained(p)


def resolve_model_class(hf_config: Any, model_refs: dict[str, str]) -> type[nn.Module]:
    """The registered model class for the first of the checkpoint's architectures we know."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in model_refs:
            return import_ref(model_refs[arch])
    raise UnknownArchitectureError(
        f"no model registered for architecture(s) {archs or '[none in config.json]'}. "
        f"Registered: {', '.join(sorted(model_refs)) or 'none'}. A plugin can add one "
        "with the register_models hook."
    )


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and hasattr(torch, value):
        return getattr(torch, value)
    return None


# --- safetensors ----------------------------------------------------------------------


def iter_safetensors(path: str | pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of ``model.safetensors`` or of the shards listed in its index file."""
    from safetensors import safe_open

    p = pathlib.Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (p / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
    if not files:
        raise MissingWeightsError(f"no safetensors weights found in {str(p)!r}")
    for name in files:
        with safe_open(str(p / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, f.get_tensor(key)


def iter_weights(
    path: str | pathlib.Path, hf_config: Any, keep_quantized: tuple[str, ...] = ()
) -> Iterator[tuple[str, Any]]:
    if is_gguf(path):
        return iter_gguf(path, hf_config, keep_quantized)
    return iter_safetensors(path)


# --- GGUF -----------------------------------------------------------------------------

_GGUF_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LLAMA_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str) -> Any:
    """Parsing a GGUF's metadata takes seconds (large token tables); reading the config
    and then the tensors share one memory-mapped reader."""
    import gguf

    return gguf.GGUFReader(str(path))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def gguf_hf_config(path: str | pathlib.Path) -> Any:
    """The HF-equivalent config of a GGUF file, read from its metadata (llama only)."""
    from transformers import LlamaConfig

    reader = _gguf_reader(str(pathlib.Path(path).resolve()))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnknownArchitectureError(
            f"GGUF architecture {arch!r} is not supported by the GGUF loader (only 'llama')"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=not has_output,
        dtype="float32",
    )


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's two rotary halves; restore HF's half-split order."""
    out_dim = w.shape[0]
    return (
        w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def iter_gguf(
    path: str | pathlib.Path, hf_config: Any, keep_quantized: tuple[str, ...] = ()
) -> Iterator[tuple[str, Any]]:
    """GGUF tensors under HF llama names: de-quantized, or for the projections of the
    layers (``blk.*``) whose block format is named in ``keep_quantized``, the blocks."""
    from gguf.quants import dequantize

    reader = _gguf_reader(str(pathlib.Path(path).resolve()))
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GGUF_LLAMA_NAMES:
            hf_name = _GGUF_LLAMA_NAMES[name]
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in _GGUF_LLAMA_BLOCK:
                logger.debug("skipping GGUF tensor %s", name)
                continue
            hf_name = f"model.layers.{layer}.{_GGUF_LLAMA_BLOCK[kind]}.{suffix}"
        else:
            logger.debug("skipping GGUF tensor %s", name)
            continue
        # GGUF lists dims fastest-first; the de-quantized array is row-major HF shape.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if (
            tensor.tensor_type.name in keep_quantized
            and name.startswith("blk.")
            and len(shape) == 2
        ):
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(shape[0], -1)
            if name.endswith("attn_q.weight"):
                raw = _unpermute_rope(raw, n_heads)
            elif name.endswith("attn_k.weight"):
                raw = _unpermute_rope(raw, n_kv)
            yield hf_name, QuantizedTensor(raw, tensor.tensor_type.name, shape)
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        # np.array copies: de-quantized F32/F16 tensors may be read-only views of the mmap.
        weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        if name.endswith("attn_q.weight"):
            weight = _unpermute_rope(weight, n_heads)
        elif name.endswith("attn_k.weight"):
            weight = _unpermute_rope(weight, n_kv)
        yield hf_name, weight


def load_gguf_tokenizer(path: str | pathlib.Path) -> Any:
    """The tokenizer stored in a GGUF file (through transformers)."""
    from transformers import AutoTokenizer

    p = pathlib.Path(path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


__all__ = ["MissingWeightsError", "load_params"]
