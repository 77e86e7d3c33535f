"""The steady-decode path (a step of the same decodes as the last one reuses that step's
rows) through preemption, prefix caching and chunked prefill mixed with decodes: every
step's inputs (ids, positions, slot mapping, block table, the decode mirror's plan) are
those the scheduler's outputs call for, on the path that built them; the tokens are
those of the general path and of transformers. The ``cpu`` backend (the mirror orders
the decodes) and the ``torch`` backend (the scheduler's order), sync and async.
"""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts
from tests.helpers.step_inputs import StepInputs

MAX_TOKENS = 24


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steady_decode_through_preemption_prefix_caching_and_chunks(
    tiny_llama, backend: str, async_scheduling: bool
) -> None:
    prompts = mixed_prompts(2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        async_scheduling=async_scheduling,
        attention_backend=backend,
        max_num_batched_tokens=32,  # long prompts are split across steps
        max_num_seqs=16,
        block_size=16,
        prefix_caching=True,
        num_blocks_override=24,  # 23 usable blocks for more demand: preemption
    ) as llm:
        runner = llm.engine_client.engine.executor.worker.model_runner
        results = []
        for steady in (True, False):
            runner.decode_shortcut = steady  # off: every step through the general path
            record = StepInputs.attach(runner)
            outputs = llm.generate(inputs, params)
            record.check(
                {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outputs}
            )
            results.append([list(o.outputs[0].token_ids) for o in outputs])
            sos = [s.so for s in record.steps]
            assert any(so.preempted_req_ids for so in sos), "no preemption"
            assert any(n.num_computed_tokens for so in sos for n in so.scheduled_new_reqs), (
                "no prefix-cache hit"
            )
            assert any(0 < s.num_decodes < len(s.req_ids) for s in record.steps), (
                "no chunk of a prompt beside decodes"
            )
            if steady:
                assert record.steady_steps > 0, "no step took the steady-decode path"
                after_preemption = False
                for s in record.steps:
                    after_preemption |= bool(s.so.preempted_req_ids)
                    if s.steady and after_preemption:
                        break
                else:
                    raise AssertionError("no steady step after a preemption")
            else:
                assert record.steady_steps == 0
    assert results[0] == results[1], "the steady path's tokens differ from the general path's"
    for prompt, tokens in zip(prompts, results[0], strict=True):
        reference = greedy_reference(tiny_llama, prompt, MAX_TOKENS)
        assert_matches_reference(tokens, reference, f"prompt of {len(prompt)}")
