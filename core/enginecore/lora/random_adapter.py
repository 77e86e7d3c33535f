"""Seeded random PEFT LoRA adapters for a checkpoint, made offline with PEFT itself.

PEFT starts B at zero (an adapter that changes nothing); these adapters get random A
and B, so every targeted projection moves the model's output. Used by the tests and the
LoRA benchmark; needs ``peft`` (in the ``test`` extra).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence


def make_random_adapter(
    base: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
) -> pathlib.Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for ``base`` with
    PEFT's ``LoraConfig`` and ``save_pretrained``; returns ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out = pathlib.Path(out_dir)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out
