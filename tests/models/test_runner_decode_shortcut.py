"""A step of decodes only takes its inputs in a few array operations (the runner's
decode shortcut), and a step of the same decodes as the last one reuses that step's rows
(the steady-decode path): the tokens are those of the general path and of transformers,
and every step's inputs (ids, positions, slot mapping, block table, the decode mirror's
plan) are those the scheduler's outputs call for (``tests/helpers/step_inputs.py``).

Requests of different prompt and output lengths, with fewer sequences allowed than
requests, so that steps alternate between decodes only (the shortcut) and steps where
new prompts join or requests leave (the general path); sync and async scheduling.
``test_runner_steady_decode.py`` adds preemption, prefix caching and chunked prefill.
"""

from __future__ import annotations

import random

import pytest

from enginecore import LLM, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.step_inputs import StepInputs

_RNG = random.Random(5)
PROMPTS = [[_RNG.randrange(10, 8000) for _ in range(_RNG.randint(2, 40))] for _ in range(7)]
LENGTHS = [_RNG.randint(3, 24) for _ in PROMPTS]


@pytest.fixture(scope="module")
def references(tiny_llama):
    return [greedy_reference(tiny_llama, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_shortcut_matches_general_path_and_transformers(
    tiny_llama, references, async_scheduling
) -> None:
    prompts, lengths = PROMPTS, LENGTHS
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        async_scheduling=async_scheduling,
        max_num_seqs=4,
        max_model_len=128,
    ) as llm:
        runner = llm.engine_client.engine.executor.worker.model_runner
        record = StepInputs.attach(runner)
        outputs = llm.generate(inputs, params)
        shortcut = [o.outputs[0].token_ids for o in outputs]
        record.check({o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outputs})
        taken = runner.decode_shortcut_steps
        assert record.steady_steps > 0, "no step took the steady-decode path"
        runner.decode_shortcut = False  # every step through the general path
        record = StepInputs.attach(runner)
        outputs = llm.generate(inputs, params)
        general = [o.outputs[0].token_ids for o in outputs]
        record.check({o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outputs})
        assert runner.decode_shortcut_steps == taken, "the switch did not turn it off"
        assert record.steady_steps == 0, "the switch did not turn the steady path off"
    assert taken > 0, "no step took the decode shortcut"
    assert shortcut == general
    for i, reference in enumerate(references):
        assert_matches_reference(list(shortcut[i]), reference, f"request {i}")
