"""The engine thread sleeps once per step while the worker runs it: the ``uni``
executor's forward and sampling are handed over as two calls, and the engine waits for
both with one wake-up (not one per call), sync and async scheduling alike. Every thread
hand-off is a sleep and a wake on the step's critical path, and on a loaded host each
wake waits for a core."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from enginecore import LLM, SamplingParams

MAX_TOKENS = 24


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_wake_of_the_engine_thread_per_step(
    tiny_llama: Any, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        num_blocks_override=64,
        async_scheduling=async_scheduling,
    ) as llm:
        executor = llm.engine_client.engine.executor
        steps = 0
        sample_tokens = executor.sample_tokens

        def counted_sample(*args: Any, **kwargs: Any) -> Any:
            nonlocal steps
            steps += 1
            return sample_tokens(*args, **kwargs)

        monkeypatch.setattr(executor, "sample_tokens", counted_sample)
        sleeps = 0
        wait = threading.Condition.wait

        def counted_wait(self: threading.Condition, timeout: float | None = None) -> bool:
            nonlocal sleeps
            if threading.current_thread().name == "enginecore-engine":
                sleeps += 1
            return wait(self, timeout)

        monkeypatch.setattr(threading.Condition, "wait", counted_wait)
        outputs = llm.generate(
            [{"prompt_token_ids": [3 + i, 7, 11 + i]} for i in range(4)],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        monkeypatch.undo()
    assert [len(out.outputs[0].token_ids) for out in outputs] == [MAX_TOKENS] * 4
    assert steps >= MAX_TOKENS
    assert sleeps <= steps, f"the engine thread slept {sleeps} times in {steps} steps"
