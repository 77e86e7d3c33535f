"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window) against transformers.

The window (16 positions) is far shorter than the prompts and outputs, so every prefill
chunk, every decode and the decode mirror run with keys masked out of the window.
"""

from __future__ import annotations

import random

import pytest
import torch

from enginecore import LLM, SamplingParams
from enginecore.layers import layer_sliding_windows
from enginecore_models.weight_loader import load_hf_config
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference, load_reference

WINDOW = 16


def _prompts(seed: int, lengths: list[int], shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 8000) for _ in range(shared)]
    return [
        (prefix if i % 2 == 0 else []) + [rng.randrange(10, 8000) for _ in range(n)]
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_reference_really_applies_the_window(checkpoint_factory, arch: str) -> None:
    """Same weights with and without a window: transformers' logits agree inside the
    window and differ past it, so the engine tests below can fail."""
    windowed = load_reference(str(checkpoint_factory(arch, sliding_window=WINDOW)))
    full = load_reference(str(checkpoint_factory(arch)))
    ids = torch.tensor([_prompts(0, [60])[0]])
    with torch.inference_mode():
        a, b = windowed(ids).logits[0], full(ids).logits[0]
    torch.testing.assert_close(a[:WINDOW], b[:WINDOW], atol=2e-5, rtol=0)
    assert float((a[WINDOW + 8 :] - b[WINDOW + 8 :]).abs().max()) > 1e-2


def test_layer_windows_follow_transformers(checkpoint_factory) -> None:
    mistral = load_hf_config(checkpoint_factory("mistral", sliding_window=WINDOW))
    assert layer_sliding_windows(mistral) == [WINDOW] * 4
    qwen2 = load_hf_config(checkpoint_factory("qwen2", sliding_window=WINDOW))
    assert layer_sliding_windows(qwen2) == [None, None, WINDOW, WINDOW]  # max_window_layers=2
    assert layer_sliding_windows(load_hf_config(checkpoint_factory("qwen2"))) == [None] * 4
    assert layer_sliding_windows(load_hf_config(checkpoint_factory("mistral"))) == [None] * 4


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_single_request_past_the_window(checkpoint_factory, arch: str) -> None:
    path = checkpoint_factory(arch, sliding_window=WINDOW)
    prompt = _prompts(1, [45])[0]
    with LLM(path, dtype="float32", multiprocessing=False, block_size=8) as llm:
        out = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        )[0].outputs[0]
    assert_matches_reference(out.token_ids, greedy_reference(path, prompt, 30), arch)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_mixed_batch_chunked_prefill_prefix_cached(checkpoint_factory, arch: str) -> None:
    path = checkpoint_factory(arch, sliding_window=WINDOW)
    prompts = _prompts(2, [70, 5, 33, 21, 52, 12], shared=24)
    max_tokens = 24
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=20,  # prompts are split across steps, decodes mix with chunks
        block_size=8,
        prefix_caching=True,
    ) as llm:
        # The first request fills the prefix cache; the batch then hits it.
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1))
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
    assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids,
            greedy_reference(path, prompt, max_tokens),
            f"{arch} prompt of {len(prompt)}",
        )
