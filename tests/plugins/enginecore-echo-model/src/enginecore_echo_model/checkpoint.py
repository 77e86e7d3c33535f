"""Write an EchoForCausalLM checkpoint: Llama-style config.json, tokenizer, one weight."""

from __future__ import annotations

import os
import pathlib

# Tools go in a system turn; assistant tool calls are written in the hermes format.
CHAT_TEMPLATE = (
    "{% if tools %}<|bos|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
    "<|eos|>\n{% endif %}"
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def make_echo_checkpoint(out_dir: str | os.PathLike[str], logit: float = 40.0) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from enginecore.checkpoints import make_tokenizer

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["EchoForCausalLM"],
    )
    config.save_pretrained(out)
    save_file({"logit": torch.tensor([logit])}, str(out / "model.safetensors"))
    return out
