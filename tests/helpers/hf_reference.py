"""transformers as the reference: unpadded single-prompt greedy generation, with near-ties.

Random weights can put two logits within float noise of each other; a different (but
equally correct) summation order then picks the other token. We therefore compare up to
the first step whose top-2 logit gap in the reference is below ``TIE_GAP``.
"""

from __future__ import annotations

import functools
import pathlib

import torch

TIE_GAP = 1e-4


@functools.lru_cache(maxsize=4)
def load_reference(path: str, dtype: torch.dtype = torch.float32, gguf_file: str | None = None):
    """The model at ``path`` (with ``gguf_file``: that GGUF file in it, de-quantized by
    transformers' own reader)."""
    from transformers import AutoModelForCausalLM

    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    model.eval()
    model.generation_config.eos_token_id = None  # compare fixed lengths (ignore_eos)
    return model


def half_precision_tie(top2: torch.Tensor) -> bool:
    """Two bfloat16 logits at most two bfloat16 steps apart (8 significant bits). Every
    layer rounds its output to bfloat16, so another summation order moves each logit by
    about a step: two logits two steps apart can meet (seen: 1.2109 and 1.1953, exactly
    1.2070 and 1.1954, both rounded to 1.2031)."""
    step = 2.0 ** (torch.frexp(top2[0].abs()).exponent.item() - 8)
    return float(top2[0] - top2[1]) <= 2 * step


def greedy_reference(
    path: str | pathlib.Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    gguf_file: str | None = None,
) -> tuple[list[int], int]:
    """``(tokens, first_tie)``: the index of the first near-tie step, or len(tokens).
    In bfloat16, a near tie is one bfloat16 step (``half_precision_tie``)."""
    model = load_reference(str(path), dtype, gguf_file)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    for step, scores in enumerate(out.scores):
        top2 = torch.topk(scores[0].float(), 2).values
        if float(top2[0] - top2[1]) < TIE_GAP or (
            dtype == torch.bfloat16 and half_precision_tie(top2)
        ):
            return tokens, step
    return tokens, len(tokens)


def assert_matches_reference(ours: list[int], reference: tuple[list[int], int], label: str) -> None:
    tokens, first_tie = reference
    assert len(ours) == len(tokens), f"{label}: {len(ours)} tokens, expected {len(tokens)}"
    assert ours[:first_tie] == tokens[:first_tie], (
        f"{label}: ours {ours} != transformers {tokens} (compared the first {first_tie})"
    )
