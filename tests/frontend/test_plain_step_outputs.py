"""The output processor folds a plain step (one new token, nothing else) of a request
without stop strings or logprobs through a fast path: the request outputs, the text and
the iteration statistics must be those of the general path, for every output kind and for
the samples of an ``n > 1`` request."""

from __future__ import annotations

import random
from typing import Any

import pytest

from enginecore.checkpoints import make_tokenizer
from enginecore.engine import output as output_module
from enginecore.engine.detokenizer import IncrementalDetokenizer
from enginecore.engine.output import OutputKind, OutputProcessor
from enginecore.metrics.iteration import IterationStatsBuilder
from enginecore.params import SamplingParams
from enginecore.protocol import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest
from enginecore.request import FinishReason

TOKENIZER = make_tokenizer(1024)
STEPS = 24


def _requests() -> list[tuple[str, SamplingParams, OutputKind]]:
    return [
        ("delta", SamplingParams(max_tokens=STEPS), OutputKind.DELTA),
        ("cumulative", SamplingParams(max_tokens=STEPS), OutputKind.CUMULATIVE),
        ("final", SamplingParams(max_tokens=STEPS), OutputKind.FINAL_ONLY),
        ("specials", SamplingParams(max_tokens=STEPS, skip_special_tokens=False), OutputKind.DELTA),
        ("pair", SamplingParams(max_tokens=STEPS, n=2), OutputKind.CUMULATIVE),
        ("pair_final", SamplingParams(max_tokens=STEPS, n=2), OutputKind.FINAL_ONLY),
        # Not plain: stop strings and logprobs always take the general path.
        ("stops", SamplingParams(max_tokens=STEPS, stop=["zz"]), OutputKind.DELTA),
    ]


def _steps(engine_ids: list[str]) -> list[list[EngineCoreOutput]]:
    """First tokens with events, plain steps (ids over the whole vocabulary, special ones
    and pieces of multi-byte characters included), then a step that finishes each."""
    rng = random.Random(0)
    vocab = len(TOKENIZER)
    steps = [
        [
            EngineCoreOutput(
                rid,
                [rng.randrange(vocab)],
                events=[(EngineCoreEventType.SCHEDULED, 1.0)],
                num_cached_tokens=4,
            )
            for rid in engine_ids
        ]
    ]
    for _ in range(STEPS - 2):
        steps.append([EngineCoreOutput(rid, [rng.randrange(vocab)]) for rid in engine_ids])
    steps.append(
        [
            EngineCoreOutput(rid, [rng.randrange(vocab)], finish_reason=FinishReason.LENGTH)
            for rid in engine_ids
        ]
    )
    return steps


def _is_plain_row(out: EngineCoreOutput) -> bool:
    return len(out.new_token_ids) == 1 and out.events is None and out.finish_reason is None


def _fold(fast: bool, columns: bool = False) -> tuple[list[Any], list[Any], int]:
    """Every step's request outputs and statistics; how many outputs took ``apply``.
    ``columns``: each step's plain rows arrive as the engine sends them, in columns."""
    processor = OutputProcessor(TOKENIZER)
    engine_ids: list[str] = []
    for rid, params, kind in _requests():
        request = EngineCoreRequest(rid, [5, 6, 7], params, arrival_time=0.0)
        engine_ids += [
            r.request_id for r in processor.add_engine_request(request, None, output_kind=kind)
        ]
    general_calls = 0
    for state in processor.states.values():
        state.times.arrival = 0.0  # the same clock in both runs
        if not fast:
            state.plain = False
        apply = state.apply

        def counted(out: EngineCoreOutput, now: float, apply: Any = apply) -> str | None:
            nonlocal general_calls
            general_calls += 1
            return apply(out, now)

        state.apply = counted  # type: ignore[method-assign]
    outputs, stats = [], []
    for i, step in enumerate(_steps(engine_ids)):
        now = 2.0 + i
        builder = IterationStatsBuilder(now)
        if columns:
            plain = [out for out in step if _is_plain_row(out)]
            rest = [out for out in step if not _is_plain_row(out)]
            ready, to_abort = processor.process_outputs(rest, now, builder)
            more, more_to_abort = processor.process_plain(
                [out.request_id for out in plain],
                [out.new_token_ids[0] for out in plain],
                now,
                builder,
            )
            ready += more
            to_abort += more_to_abort
        else:
            ready, to_abort = processor.process_outputs(step, now, builder)
        assert to_abort == []
        outputs.append(sorted((out for _, out in ready), key=_output_key))
        stats.append(builder.stats)
    assert not processor.has_unfinished_requests()
    if columns:
        # Every plain row of a request without stop strings took the one pass.
        assert processor.num_plain_rows == (5 + 2 + 2 - 1) * (STEPS - 2)
    return outputs, stats, general_calls


def _output_key(output: Any) -> tuple[str, list[int]]:
    return output.request_id, [c.index for c in output.outputs]


def test_plain_steps_fold_as_the_general_path_folds_them() -> None:
    fast_outputs, fast_stats, fast_general = _fold(fast=True)
    outputs, stats, general = _fold(fast=False)
    assert fast_outputs == outputs
    assert fast_stats == stats
    engine_requests = 5 + 2 + 2  # n=2 requests count twice
    assert general == engine_requests * STEPS
    # Only the stop-string request, the first and the finishing step go the general way.
    assert fast_general == engine_requests * 2 + (STEPS - 2)
    final = {o.request_id: o for step in outputs for o in step if o.finished}
    assert all(len(c.token_ids) == STEPS for c in final["final"].outputs)
    assert final["final"].outputs[0].text  # detokenized along the fast path too


def test_plain_columns_fold_as_the_objects_fold() -> None:
    """The engine's plain rows in columns (``process_plain``) give the outputs, text and
    statistics of the same rows as objects; a request with stop strings among them takes
    the general path."""
    column_outputs, column_stats, column_general = _fold(fast=True, columns=True)
    outputs, stats, _ = _fold(fast=False)
    assert column_outputs == outputs
    for got, want in zip(column_stats, stats, strict=True):
        assert sorted(got.inter_token_latencies) == sorted(want.inter_token_latencies)
        got.inter_token_latencies = want.inter_token_latencies
        assert got == want
    engine_requests = 5 + 2 + 2
    assert column_general == engine_requests * 2 + (STEPS - 2)


def test_final_only_plain_steps_leave_detokenizing_to_the_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose text is read only when it finishes (``LLM.generate``) pays no
    detokenization on its plain steps: their tokens are queued and folded once, with
    the text the general path gives (tokens over the whole vocabulary: special ones and
    pieces of multi-byte characters included)."""
    per_token = 0
    for name in ("_piece", "_stream_piece"):
        original = getattr(IncrementalDetokenizer, name)

        def counted(self: IncrementalDetokenizer, token_id: int, original: Any = original) -> str:
            nonlocal per_token
            per_token += 1
            result: str = original(self, token_id)
            return result

        monkeypatch.setattr(IncrementalDetokenizer, name, counted)
    processor = OutputProcessor(TOKENIZER)
    engine_ids = [f"final{i}" for i in range(6)]
    for rid in engine_ids:
        request = EngineCoreRequest(rid, [5, 6, 7], SamplingParams(max_tokens=STEPS), 0.0)
        processor.add_engine_request(request, None, output_kind=OutputKind.FINAL_ONLY)
    steps = _steps(engine_ids)
    processor.process_outputs(steps[0], 2.0)
    decoded_before = per_token
    for i, step in enumerate(steps[1:-1]):
        builder = IterationStatsBuilder(3.0 + i)
        ready, _ = processor.process_plain(
            [out.request_id for out in step],
            [out.new_token_ids[0] for out in step],
            3.0 + i,
            builder,
        )
        assert ready == []
        assert builder.stats.num_generation_tokens == len(engine_ids)
        assert builder.stats.inter_token_latencies == [1.0] * len(engine_ids)
    assert per_token == decoded_before, "a plain step of a FINAL_ONLY request detokenized"
    assert processor.num_plain_rows == len(engine_ids) * (len(steps) - 2)
    ready, _ = processor.process_outputs(steps[-1], 3.0 + len(steps))
    texts = {out.request_id: out.outputs[0].text for _, out in ready}
    for rid in engine_ids:
        eager = IncrementalDetokenizer(TOKENIZER, SamplingParams())
        for step in steps:
            (token_id,) = (out.new_token_ids[0] for out in step if out.request_id == rid)
            eager.update([token_id])
        assert texts[rid] == eager.text
    assert len(texts) == len(engine_ids) and any(texts.values())


def test_queued_tokens_are_folded_on_the_step_past_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long FINAL_ONLY output does not leave its whole text to its finish (one slow
    step for every other request): past a per-request bound, staggered between requests,
    the queue is folded on the step, beside a streaming request and without one."""
    monkeypatch.setattr(output_module, "FOLD_AT", 4)
    processor = OutputProcessor(TOKENIZER)
    engine_ids = [f"long{i}" for i in range(6)]
    kinds = {"long0": OutputKind.DELTA}  # in the first half, a streaming request beside
    for rid in engine_ids:
        request = EngineCoreRequest(rid, [5, 6, 7], SamplingParams(max_tokens=STEPS), 0.0)
        kind = kinds.get(rid, OutputKind.FINAL_ONLY)
        processor.add_engine_request(request, None, output_kind=kind)
    steps = _steps(engine_ids)
    processor.process_outputs(steps[0], 2.0)
    longest = 0
    for i, step in enumerate(steps[1:-1]):
        rows = [out for out in step if i >= STEPS // 2 or out.request_id != "long0"]
        if i == STEPS // 2:
            processor.abort_requests(["long0"])  # the rest of the steps: FINAL_ONLY rows only
        processor.process_plain(
            [out.request_id for out in rows], [out.new_token_ids[0] for out in rows], 3.0 + i
        )
        queues = [s.queued_ids for s in processor.states.values() if s.queued_ids is not None]
        longest = max(longest, *map(len, queues))
    assert longest < 8
    ready, _ = processor.process_outputs(
        [out for out in steps[-1] if out.request_id != "long0"], 3.0 + len(steps)
    )
    texts = {out.request_id: out.outputs[0].text for _, out in ready}
    for rid in engine_ids[1:]:
        eager = IncrementalDetokenizer(TOKENIZER, SamplingParams())
        for step in steps:
            (token_id,) = (out.new_token_ids[0] for out in step if out.request_id == rid)
            eager.update([token_id])
        assert texts[rid] == eager.text
