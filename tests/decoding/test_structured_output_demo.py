"""Structured output on the real demo model (SmolLM2-135M-Instruct), with its chat template.

A trained model needs no help with whitespace: the default (any whitespace) is used.
The fast check shares the demo engine of ``test_demo_model.py``; these are the full runs.
"""

from __future__ import annotations

import json

import pytest

from enginecore import LLM, SamplingParams, StructuredOutputParams
from tests.helpers.structured import run_mixed_batch


@pytest.fixture(scope="module")
def demo_model():
    from enginecore.checkpoints import make_demo_checkpoint

    return make_demo_checkpoint()


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
