"""The offline ``LLM`` sleeps and wakes up as vLLM's does, like ``AsyncLLM`` and the server,
with its engine in this process too (the engine process's sleep is test_engine_process's)."""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams


def test_llm_sleeps_and_wakes_up_and_generates_the_same(tiny_llama):
    greedy = SamplingParams(max_tokens=4, temperature=0)
    with LLM(
        model=str(tiny_llama), max_model_len=128, num_blocks_override=32, multiprocessing=False
    ) as llm:
        before = llm.generate(["The sky is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep(level=1)
        assert llm.is_sleeping() is True
        with pytest.raises(Exception, match="engine_paused: the engine is asleep"):
            llm.generate(["The sky is"], greedy, use_tqdm=False)
        llm.wake_up()
        assert llm.is_sleeping() is False
        after = llm.generate(["The sky is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
