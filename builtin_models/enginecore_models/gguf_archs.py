"""What each GGUF architecture means in transformers' terms: its config, read from the
file's metadata, and its tensor names, with llama.cpp's conventions undone.

llama.cpp's converter interleaves the two rotary halves of Llama's Q/K rows (undone by
``unpermute_rope``; the other architectures rotate NeoX-style and are stored as they
are), stores Gemma's norm weights as ``1 + w`` (``w`` is restored), splits MoE experts
into 3-D ``ffn_*_exps`` tensors and carries Phi-3's LongRoPE factors and Llama 3's RoPE
scaling (``rope_freqs``) as tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from enginecore.block_formats import kquant_blocks
from enginecore.block_formats.parts import dequantized_part, unpacked
from enginecore.errors import UnsupportedModelError
from enginecore.layers.quantized import QuantizedTensor

# GGUF architecture -> (transformers config class, HF architecture)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}

TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Gemma 2/3 have four norms a layer: llama.cpp names them after their place.
GEMMA_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}


def gguf_config(arch: str, field: Callable[[str, Any], Any], tensors: dict[str, Any]) -> Any:
    """The transformers config of a GGUF file of ``arch``; ``field(key, default)`` reads
    its metadata, ``tensors`` maps tensor names to the reader's tensors."""
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    config_cls, hf_arch = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return field(f"{arch}.{key}", default)

    tokens = field("tokenizer.ggml.tokens", None) or []
    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    kwargs: dict[str, Any] = dict(
        vocab_size=int(meta("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length", 4 * hidden)),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        bos_token_id=field("tokenizer.ggml.bos_token_id", None),
        eos_token_id=field("tokenizer.ggml.eos_token_id", None),
        pad_token_id=field("tokenizer.ggml.padding_token_id", None),
        tie_word_embeddings="output.weight" not in tensors,
        dtype="float32",
    )
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
    }
    scaling = meta("rope.scaling.type", None)
    if scaling not in (None, "none"):
        rope.update(rope_type=str(scaling), factor=float(meta("rope.scaling.factor", 1.0)))
        original = meta("rope.scaling.original_context_length", None)
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
    if "rope_freqs.weight" in tensors:  # Llama 3's scaling, per frequency
        rope["freq_factors"] = _floats(tensors["rope_freqs.weight"])
    if arch == "qwen3moe":
        kwargs.update(
            num_experts=int(meta("expert_count")),
            num_experts_per_tok=int(meta("expert_used_count")),
            moe_intermediate_size=int(meta("expert_feed_forward_length")),
            norm_topk_prob=True,  # llama.cpp renormalises Qwen3-MoE's top-k weights
        )
    elif arch in ("gemma2", "gemma3"):
        window = meta("attention.sliding_window", None)
        kwargs.update(
            sliding_window=None if window is None else int(window),
            query_pre_attn_scalar=head_dim,  # llama.cpp scales queries by the head size
            hidden_activation="gelu_pytorch_tanh",
        )
        if arch == "gemma2":
            kwargs.update(
                attn_logit_softcapping=meta("attn_logit_softcapping", None),
                final_logit_softcapping=meta("final_logit_softcapping", None),
            )
        else:
            # Local layers: llama.cpp's fixed base, unscaled. The pattern is a period
            # (every sixth layer global by default) or one flag per layer (True: local).
            pattern = meta("attention.sliding_window_pattern", 6)
            layers = range(kwargs["num_hidden_layers"])
            local = (
                [bool(pattern[i]) for i in layers]
                if isinstance(pattern, list)
                else [bool((i + 1) % int(pattern)) for i in layers]
            )
            kwargs["layer_types"] = [
                "sliding_attention" if is_local else "full_attention" for is_local in local
            ]
            rope = {
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }
    elif arch == "phi3":
        rot = int(meta("rope.dimension_count", head_dim))
        window = meta("attention.sliding_window", None)
        kwargs.update(
            partial_rotary_factor=rot / head_dim,
            sliding_window=None if not window else int(window),
        )
        rope["partial_rotary_factor"] = rot / head_dim
        if "rope_factors_long.weight" in tensors:
            original = int(
                meta("rope.scaling.original_context_length", kwargs["max_position_embeddings"])
            )
            kwargs["original_max_position_embeddings"] = original
            rope.update(
                rope_type="longrope",
                long_factor=_floats(tensors["rope_factors_long.weight"]),
                short_factor=_floats(tensors["rope_factors_short.weight"]),
                original_max_position_embeddings=original,
            )
            attn_factor = meta("rope.scaling.attn_factor", None)
            if attn_factor is not None:
                rope["attention_factor"] = float(attn_factor)
    kwargs["rope_parameters"] = rope
    if arch == "llama":
        from enginecore_models.gguf_llama_config import gguf_llama_config

        config = gguf_llama_config(**kwargs)
    else:
        import transformers

        config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [hf_arch]
    return config


def _floats(tensor: Any) -> list[float]:
    return [float(v) for v in dequantized(tensor).reshape(-1)]


_TORCH_FORMATS = {"Q4_0", "Q4_1", *kquant_blocks.FORMATS}


def dequantized(tensor: Any) -> torch.Tensor:
    """A reader tensor as float32, in the row-major HF shape (GGUF lists dims
    fastest-first)."""
    import numpy as np
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    kind = tensor.tensor_type.name
    if kind == "Q8_0":
        return _q8_0(tensor.data, shape)
    if kind in _TORCH_FORMATS and len(shape) == 2:
        # torch's de-quantization of these formats forms the same float32 products and
        # sums as gguf's numpy one (each product is exact), many times faster.
        raw = torch.from_numpy(tensor.data).reshape(shape[0], -1)
        return dequantized_part(unpacked(QuantizedTensor(raw, kind, (shape[0], shape[1]))))
    array = dequantize(tensor.data, tensor.tensor_type)
    # np.array copies: de-quantized F32/F16 tensors may be read-only views of the mmap.
    return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)


def _q8_0(data: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """Q8_0 blocks (a float16 scale, 32 signed bytes) as float32: the products gguf's
    numpy de-quantizer rounds, in torch (a Q8_0 embedding of 49,152 x 576 took about a
    second there, a twentieth of that here)."""
    import numpy as np

    # One new float32 tensor, scaled in place: fresh memory is the cost here (page faults).
    raw = np.asarray(data, dtype=np.uint8) if data.flags.writeable else np.array(data, np.uint8)
    blocks = torch.from_numpy(raw).reshape(-1, 34)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].view(torch.int8).float().mul_(scale).reshape(shape)


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's two rotary halves; restore HF's half-split order."""
    out_dim = w.shape[0]
    return (
        w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def hf_tensors(
    arch: str,
    name: str,
    weight: torch.Tensor,
    hf_config: Any,
    unpermute: Callable[[torch.Tensor, int], Any] = unpermute_rope,
) -> Iterator[tuple[str, Any]]:
    """The HF tensors one GGUF tensor holds (none for what the model does not use; every
    expert's slice for a 3-D expert tensor). ``unpermute(weight, heads)`` undoes the
    rotary interleave of a Llama q/k weight (a caller may defer it)."""
    if name in TOP_LEVEL_NAMES:
        if arch in ("gemma2", "gemma3") and name == "output_norm.weight":
            weight = weight - 1
        yield TOP_LEVEL_NAMES[name], weight
        return
    if not name.startswith("blk."):
        return  # rope_factors_* (read into the config) and the like
    _, layer, kind, suffix = name.split(".", 3)
    prefix = f"model.layers.{layer}"
    if kind in EXPERT_TENSORS:
        for e in range(weight.shape[0]):
            yield f"{prefix}.mlp.experts.{e}.{EXPERT_TENSORS[kind]}.{suffix}", weight[e]
        return
    gemma = arch in ("gemma2", "gemma3")
    names = GEMMA_BLOCK_NAMES if gemma else BLOCK_NAMES
    if kind not in names:
        return
    if arch == "phi3" and kind == "ffn_up":
        kind, target = kind, "mlp.gate_up_proj"  # Phi-3's fused gate and up
    else:
        target = names[kind]
    if gemma and kind.endswith("norm"):
        weight = weight - 1
    if arch == "llama" and kind in ("attn_q", "attn_k") and suffix == "weight":
        heads = hf_config.num_attention_heads
        if kind == "attn_k":
            heads = getattr(hf_config, "num_key_value_heads", None) or heads
        yield f"{prefix}.{target}.{suffix}", unpermute(weight, heads)
        return
    yield f"{prefix}.{target}.{suffix}", weight
