"""Write a test checkpoint as a GGUF file the way llama.cpp's converter does.

Q/K rows of Llama interleaved per head, Gemma norms stored as ``1 + w``, MoE experts
stacked into ``ffn_*_exps``, Phi-3's LongRoPE factors as tensors, the byte-level BPE
tokenizer as ``tokenizer.ggml.*`` with the chat template. Tensors are F32 (exact) or,
for the quantized case, Q8_0.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Callable

import numpy as np
import torch

GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}

_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_BLOCK = {
    **_BLOCK,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    checkpoint: pathlib.Path,
    out: pathlib.Path,
    quantize: bool = False,
    types: Callable[[str], str | None] | None = None,
) -> pathlib.Path:
    """``types``, where given, names each 2-D tensor's GGUF type (``Q4_K``...; None:
    as ``quantize`` says) by its GGUF name."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    gemma = arch in ("gemma2", "gemma3")
    writer = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if gemma and "full_attention" in rope:
        rope = rope["full_attention"]
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if gemma:
        writer.add_sliding_window(cfg["sliding_window"])
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        else:
            writer.add_sliding_window_pattern(
                [t == "sliding_attention" for t in cfg["layer_types"]]
            )
    tensors = load_file(str(checkpoint / "model.safetensors"))
    if arch == "llama" and rope.get("rope_type") == "llama3":
        # llama.cpp writes Llama 3's scaling as per-frequency divisors.
        from enginecore.layers.rotary import _base_inv_freq, _llama3

        base = _base_inv_freq(head_dim, rope["rope_theta"])
        writer.add_tensor("rope_freqs.weight", (base / _llama3(base, rope)).numpy())
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    _add_tokenizer(writer, checkpoint)
    if cfg["vocab_size"] != len(
        json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    ):
        writer.add_vocab_size(cfg["vocab_size"])  # an embedding wider than the tokenizer

    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, w in tensors.items():
        w = w.float()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gg = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
            if gemma and gg == "output_norm.weight":
                w = w + 1
            _add(writer, gg, w, quantize, types)
            continue
        match = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if match:
            layer, expert, proj = match.groups()
            experts.setdefault((layer, proj), {})[int(expert)] = w
            continue
        match = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        layer, module, suffix = match.groups()
        kind = (_GEMMA_BLOCK if gemma else _BLOCK)[module]
        if gemma and kind.endswith("norm"):
            w = w + 1
        if arch == "llama" and kind in ("attn_q", "attn_k") and suffix == "weight":
            w = _permute(w, heads if kind == "attn_q" else kv_heads)
        _add(writer, f"blk.{layer}.{kind}.{suffix}", w, quantize and w.dim() == 2, types)
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        kind = {
            "gate_proj": "ffn_gate_exps",
            "up_proj": "ffn_up_exps",
            "down_proj": "ffn_down_exps",
        }
        _add(writer, f"blk.{layer}.{kind[proj]}.weight", stacked, quantize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add(writer, name: str, w: torch.Tensor, quantize: bool, types=None) -> None:
    import gguf
    from gguf.quants import quantize as q

    from enginecore.testing.quantizers import quantize_k

    array = w.numpy().astype(np.float32)
    fmt = types(name) if types is not None and w.dim() == 2 else None
    if fmt is not None:
        qtype = gguf.GGMLQuantizationType[fmt]
        raw = quantize_k(w, fmt) if fmt.endswith("_K") else q(array, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    elif quantize and w.dim() >= 2 and w.shape[-1] % 32 == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, q(array, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, array)


def _add_tokenizer(writer, checkpoint: pathlib.Path) -> None:
    """The byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"]: a["id"] for a in tok["added_tokens"]}
    types = [3 if t in special else 1 for t in tokens]  # 3: control, 1: normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["<|bos|>"])
    writer.add_eos_token_id(special["<|eos|>"])
    writer.add_pad_token_id(special["<|pad|>"])
    template = tok_cfg.get("chat_template")
    if template is None and (checkpoint / "chat_template.jinja").is_file():
        template = (checkpoint / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
