"""Structured output on the real demo model (SmolLM2-135M-Instruct), with its chat template.

A trained model needs no help with whitespace: the default (any whitespace) is used.
The fast check shares the demo engine of ``test_demo_model.py``; these are the full runs.
"""

from __future__ import annotations

import json

import pytest
from tests.helpers.structured import check, mixed_batch

from enginecore import LLM, SamplingParams, StructuredOutputParams


@pytest.fixture(scope="module")
def demo_model():
    from enginecore.checkpoints import make_demo_checkpoint

    return make_demo_checkpoint()


def chat_prompts(llm: LLM, n: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} in JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]


def run_mixed_batch(llm: LLM, num_constrained: int, num_free: int) -> None:
    params = mixed_batch(num_constrained, num_free)
    outputs = llm.generate(chat_prompts(llm, len(params)), params)
    assert sum(p.structured_output is None for p in params) == num_free
    for p, out in zip(params, outputs, strict=True):
        if p.structured_output is not None:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0]
            check(p.structured_output, out.outputs[0].text)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_demo_model_fifty_constrained_requests(demo_model, async_scheduling):
    with LLM(
        demo_model,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=64,
        async_scheduling=async_scheduling,
    ) as llm:
        run_mixed_batch(llm, 50, 10)


@pytest.mark.slow
def test_demo_model_any_json_object(demo_model):
    with LLM(demo_model, dtype="float32", multiprocessing=False, max_model_len=1024) as llm:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Alice is 30. Give her name and age as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        params = SamplingParams(
            max_tokens=100,
            temperature=0.0,
            structured_output=StructuredOutputParams(json_object=True),
        )
        [out] = llm.generate(prompt, params)
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)
