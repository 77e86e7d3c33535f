"""SamplingParams.prompt_logprobs equal transformers' teacher-forced log_softmax.

Prefill is chunked small (prompts span several steps), the batch mixes requests with
and without prompt logprobs, and prefix caching is on with a shared prefix already
cached: a request asking for prompt logprobs must still score every prompt token.
"""

from __future__ import annotations

import random

import pytest
import torch

from enginecore import LLM, SamplingParams
from enginecore.errors import InvalidRequestError
from tests.helpers.hf_reference import load_reference

ATOL = 1e-4


def reference_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """[P-1, vocab]: row i is the log-distribution over prompt token i+1."""
    model = load_reference(str(path))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def check(path, prompt: list[int], got, num_top: int) -> None:
    want = reference_prompt_logprobs(path, prompt)
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i, entry in enumerate(got[1:]):
        token = prompt[i + 1]
        assert token in entry, f"position {i + 1}: prompt token missing"
        assert entry[token].logprob == pytest.approx(float(want[i, token]), abs=ATOL)
        # Rank among the vocabulary, up to logits within float noise of the token's.
        v = want[i, token]
        lowest = int((want[i] > v + ATOL).sum()) + 1
        highest = int((want[i] > v - ATOL).sum()) + 1
        assert lowest <= entry[token].rank <= highest
        top_vals, top_ids = want[i].topk(num_top)
        others = {t: lp for t, lp in entry.items() if t != token}
        for t, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True):
            if t != token:
                assert others[t].logprob == pytest.approx(v, abs=ATOL)
        assert len(entry) in (num_top, num_top + 1)


def test_prompt_logprobs_chunked_mixed_prefix_cached(tiny_llama) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(10, 8000) for _ in range(32)]
    prompts = [
        prefix + [rng.randrange(10, 8000) for _ in range(n)]
        if n % 2
        else [rng.randrange(10, 8000) for _ in range(n)]
        for n in (41, 9, 27, 60, 2)
    ]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=16,  # every prompt but the shortest spans several chunks
        block_size=8,
        prefix_caching=True,
    ) as llm:
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1))
        params = [
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3),
            SamplingParams(max_tokens=4, temperature=0.0),  # no prompt logprobs
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=5, logprobs=2),
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1),
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert outputs[1].prompt_logprobs is None
    # The cached prefix was recomputed for the requests that asked for prompt logprobs.
    assert outputs[0].num_cached_tokens == 0
    assert outputs[1].num_cached_tokens > 0, "the shared prefix was cached for others"
    for out, prompt, p in zip(outputs, prompts, params, strict=True):
        if p.prompt_logprobs is not None:
            check(tiny_llama, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert outputs[3].outputs[0].logprobs is not None


def test_single_token_prompt_has_only_the_leading_none(tiny_llama) -> None:
    with LLM(tiny_llama, dtype="float32", multiprocessing=False) as llm:
        out = llm.generate(
            {"prompt_token_ids": [42]}, SamplingParams(max_tokens=2, prompt_logprobs=2)
        )
        assert out[0].prompt_logprobs == [None]


def test_negative_prompt_logprobs_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_survive_preemption(tiny_llama, async_scheduling: bool) -> None:
    """Preempted mid-prefill or after its first token, a request reports its prompt
    logprobs exactly once and complete."""
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 8000) for _ in range(n)] for n in (50, 45, 40, 35)]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=24,
        block_size=8,
        num_blocks_override=14,  # 13 usable blocks (104 tokens) for ~200 tokens of demand
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
        )
    assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption forced"
    for out, prompt in zip(outputs, prompts, strict=True):
        check(tiny_llama, prompt, out.prompt_logprobs, 1)
