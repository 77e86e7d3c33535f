"""With async scheduling the engine plans and launches the next batch right after a
batch's update, before that batch's outputs go back to the caller
(``EngineCore._launch_ahead``): the worker has it queued when it finishes the batch in
flight, instead of sleeping until the caller has processed the outputs and called again.

Driven through the real in-process ``LLM``: while the frontend processes a step's
outputs, two batches are in flight; the outputs are the synchronous loop's token for
token, with a stop token, a stop string and ``min_tokens`` among them (aborts and
preemption: ``test_overlap_choice.py``, every step overlapped)."""

from __future__ import annotations

from typing import Any

from enginecore import LLM, SamplingParams
from enginecore.engine.overlap_choice import OverlapChoice


class _Fixed(OverlapChoice):
    """Every step overlapped, or every step the synchronous way."""

    def __init__(self, overlap: bool) -> None:
        super().__init__(adaptive=False)
        self.way = overlap

    def overlap(self) -> bool:
        return self.way


def _generate(llm: LLM, overlap: bool, params: list[SamplingParams]) -> tuple[Any, list[int]]:
    """The outputs, and how many batches were in flight each time the frontend began
    processing a step's outputs."""
    engine = llm.engine_client.engine  # type: ignore[attr-defined]
    in_flight: list[int] = []
    process = llm._process_step

    def counting(outputs: Any) -> Any:
        in_flight.append(len(engine.batch_queue))
        return process(outputs)

    engine.overlap_choice = _Fixed(overlap)
    llm._process_step = counting  # type: ignore[method-assign]
    try:
        prompts = [{"prompt_token_ids": [7 + i, 33, 60 + 3 * i, 12]} for i in range(len(params))]
        outputs = llm.generate(prompts, params)
    finally:
        del llm._process_step  # the class's method again
        engine.overlap_choice = OverlapChoice(adaptive=False)
    got = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]
    return got, in_flight


def test_the_next_batch_is_in_flight_while_the_frontend_processes_outputs(
    async_tiny_llm: LLM,
) -> None:
    llm = async_tiny_llm
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in range(3)]
    reference, sync_in_flight = _generate(llm, False, params)
    assert set(sync_in_flight) == {0}
    got, in_flight = _generate(llm, True, params)
    assert got == reference
    # Steady decode: the batch after the one in flight was already launched.
    steady = in_flight[2:-2]
    assert steady and all(n == 2 for n in steady), in_flight


def test_launching_ahead_keeps_the_synchronous_outputs_through_stops(
    async_tiny_llm: LLM,
) -> None:
    llm = async_tiny_llm
    tokenizer = llm.get_tokenizer()
    plain = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in range(4)]
    free, _ = _generate(llm, False, plain)
    tokens = [t for t, _ in free]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokens[0][5]]),
        SamplingParams(temperature=0.0, max_tokens=16, stop=[tokenizer.decode(tokens[1][6:8])]),
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokens[2][1]], min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    ]
    reference, _ = _generate(llm, False, params)
    assert [reason for _, reason in reference][:2] == ["stop", "stop"]
    assert len(reference[2][0]) >= 4  # min_tokens held the stop token back
    got, in_flight = _generate(llm, True, params)
    assert got == reference
    assert 2 in in_flight
