"""Greedy tokens of transformers + PEFT: the reference every LoRA test compares with."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def peft_greedy(
    base: str, adapter: str | None, prompt: tuple[int, ...], max_tokens: int
) -> list[int]:
    """``max_tokens`` greedy tokens after ``prompt`` from ``base`` with ``adapter`` (None:
    the base model alone), in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.inference_mode():
        out = model.eval().generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()
