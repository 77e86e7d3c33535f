"""With async scheduling the engine runs a batch size the synchronous way where that
measured faster (``enginecore.engine.overlap_choice``).

The choice itself is driven on a clock the test moves. The engine, switching between
the two ways in an irregular pattern, must give what the synchronous loop gives:
token for token, finish reasons, stop reasons and streamed deltas, through preemption
(a KV cache of 16 blocks), an abort, stop tokens, stop strings, ``min_tokens`` and two
clients (slow; a fast sibling with a few requests)."""

from __future__ import annotations

from typing import Any

import pytest

from enginecore import LLM, SamplingParams
from enginecore.engine import overlap_choice as oc
from enginecore.engine.output import OutputKind
from enginecore.engine.overlap_choice import OverlapChoice


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_steps(
    choice: OverlapChoice, clock: Clock, size: int, costs: dict[bool, float], n: int
) -> list[bool]:
    """``n`` steps of ``size`` requests, each taking ``costs[way]`` seconds."""
    ways = []
    for _ in range(n):
        way = choice.overlap()
        clock.now += costs[way]
        choice.completed(size, way)
        ways.append(way)
    return ways


def test_a_size_where_the_synchronous_way_measures_faster_runs_it_between_probes() -> None:
    clock = Clock()
    choice = OverlapChoice(adaptive=True, clock=clock)
    choice.completed(16, True)  # a first batch: the steps below are decided for its size
    ways = _run_steps(choice, clock, 16, {True: 0.0012, False: 0.001}, 4 * oc.PERIOD)
    assert all(ways[: oc.PERIOD - oc.PROBE_STEPS])  # overlapped until the first probe
    assert not any(ways[oc.PERIOD - oc.PROBE_STEPS : oc.PERIOD])  # the probe
    later = ways[2 * oc.PERIOD :]
    # Synchronous but for one probe of the overlapped way per period (a narrow margin).
    assert later.count(True) == 2 * oc.PROBE_STEPS
    assert later[oc.PERIOD - oc.PROBE_STEPS : oc.PERIOD] == [True] * oc.PROBE_STEPS


def test_probes_are_spaced_out_while_the_other_way_loses_widely() -> None:
    clock = Clock()
    choice = OverlapChoice(adaptive=True, clock=clock)
    choice.completed(256, True)
    ways = _run_steps(choice, clock, 256, {True: 0.001, False: 0.002}, 40 * oc.PERIOD)
    tail = ways[-2 * oc.MAX_PERIOD :]
    # Still probed (once per longest period), and nearly every step overlapped.
    assert tail.count(False) == 2 * oc.PROBE_STEPS
    assert ways.count(False) < 0.03 * len(ways)


def test_sizes_are_chosen_apart() -> None:
    clock = Clock()
    choice = OverlapChoice(adaptive=True, clock=clock)
    choice.completed(256, True)
    _run_steps(choice, clock, 256, {True: 0.001, False: 0.002}, 3 * oc.PERIOD)
    # A size class of its own: 1 request measures faster synchronously, 256 do not.
    _run_steps(choice, clock, 1, {True: 0.0005, False: 0.0002}, 3 * oc.PERIOD)
    small = _run_steps(choice, clock, 1, {True: 0.0005, False: 0.0002}, oc.PERIOD)
    large = _run_steps(choice, clock, 256, {True: 0.001, False: 0.002}, oc.PERIOD)
    # (A step is decided for the size of the batch before it: the first of each list
    # for the other size.)
    assert small[1:].count(True) <= oc.PROBE_STEPS
    assert large[1:].count(False) <= oc.PROBE_STEPS


def test_switches_and_idle_gaps_are_not_measured() -> None:
    clock = Clock()
    choice = OverlapChoice(adaptive=True, clock=clock)
    ways = []
    for step in range(4 * oc.PERIOD):
        way = choice.overlap()
        # Overlapping costs 2 ms a step, the synchronous way 1 ms, but the first two
        # batches after each switch 50 ms: were they counted, overlapping would win.
        switched = len(ways) < 2 or way != ways[-1] or way != ways[-2]
        clock.now += 0.05 if switched else (0.002 if way else 0.001)
        if step % 7 == 0:
            clock.now += 2 * oc.IDLE_GAP_S  # the engine idled before this batch
        choice.completed(64, way)
        ways.append(way)
    # The synchronous way chosen: only probes overlap.
    assert ways[-2 * oc.PERIOD :].count(False) >= 2 * (oc.PERIOD - oc.PROBE_STEPS)


def test_not_adaptive_always_overlaps() -> None:
    clock = Clock()
    choice = OverlapChoice(adaptive=False, clock=clock)
    assert all(_run_steps(choice, clock, 16, {True: 0.01, False: 0.001}, 3 * oc.PERIOD))
    assert choice.counts == {True: 3 * oc.PERIOD, False: 0}


class Pattern(OverlapChoice):
    """Overlaps or not in a fixed irregular pattern, so that switches land on every kind
    of step (prefills, preemptions, finishes, the abort)."""

    PATTERN = (True, True, False, True, False, False, True, True, True, False, True, False)

    def __init__(self, pattern: tuple[bool, ...] = PATTERN) -> None:
        super().__init__(adaptive=True)
        self.pattern = pattern
        self.i = 0

    def overlap(self) -> bool:
        self.i += 1
        return self.pattern[self.i % len(self.pattern)]


NUM_REQUESTS = 12
ABORTED = 4  # aborted once the engine has returned a few steps


def _params(reference: list[list[int]] | None, texts: list[str] | None) -> list[SamplingParams]:
    params = []
    for i in range(NUM_REQUESTS):
        extra: dict[str, Any] = {}
        if reference is not None and texts is not None:
            if i % 4 == 1:  # a stop token met midway
                extra["stop_token_ids"] = [reference[i][min(14, len(reference[i]) - 1)]]
            elif i % 4 == 2 and texts[i].strip():  # a stop string met midway
                extra["stop"] = [texts[i]]
            elif i % 4 == 3:  # a stop token first sampled before min_tokens
                extra["stop_token_ids"] = [reference[i][1]]
                extra["min_tokens"] = 4
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=22 + (i * 5) % 24,
                ignore_eos=i % 2 == 0,
                **extra,
            )
        )
    return params


def _drive(llm: LLM, choice: OverlapChoice, label: str, params: list[SamplingParams]) -> Any:
    """Every request's outputs in the order they came (each delta's tokens and text,
    finish and stop reason), client 1 for the odd requests; counts preemptions."""
    engine = llm.engine_client.engine  # type: ignore[attr-defined]
    engine.overlap_choice = choice
    llm.reset_prefix_cache()
    preempt = engine.scheduler._preempt
    preempted: set[str] = set()

    def counting_preempt(request: Any) -> None:
        preempted.add(request.request_id)
        preempt(request)

    engine.scheduler._preempt = counting_preempt
    ids = [f"{label}-{i}" for i in range(NUM_REQUESTS)]
    try:
        for i, (rid, p) in enumerate(zip(ids, params, strict=True)):
            prompt = [(i * 37 + j * 11) % 900 + 20 for j in range(13 + i % 4)]
            request, text = llm.input_processor.process(rid, {"prompt_token_ids": prompt}, p)
            request.client_index = i % 2
            # Even requests stream (a delta each step), odd ones report when finished.
            kind = OutputKind.DELTA if i % 2 == 0 else OutputKind.FINAL_ONLY
            for engine_request in llm.output_processor.add_engine_request(
                request, text, output_kind=kind
            ):
                llm.engine_client.add_request(engine_request)
        seen: dict[str, list[tuple[Any, ...]]] = {rid: [] for rid in ids}
        steps = 0
        while llm.output_processor.has_unfinished_requests():
            ready, to_abort = llm._process_step(llm.engine_client.get_output())
            llm.engine_client.abort_requests(to_abort)
            for _, out in ready:
                c = out.outputs[0]
                seen[out.request_id].append(
                    (list(c.token_ids), c.text, c.finish_reason, c.stop_reason)
                )
            steps += 1
            if steps == 6:
                llm.abort(ids[ABORTED])
    finally:
        del engine.scheduler._preempt  # the class's method again
    return [seen[rid] for rid in ids], {ids.index(r) for r in preempted if r in ids}


def _tokens(outputs: list[tuple[Any, ...]]) -> list[int]:
    return [t for out in outputs for t in out[0]]


@pytest.mark.slow
def test_switching_ways_gives_the_synchronous_outputs(async_tiny_llm: LLM) -> None:
    llm = async_tiny_llm
    tokenizer = llm.get_tokenizer()
    always_sync = Pattern((False,))
    plain, _ = _drive(llm, always_sync, "plain", _params(None, None))
    reference_tokens = [_tokens(outs) for outs in plain]
    texts = [tokenizer.decode(t[15:17]) for t in reference_tokens]
    params = _params(reference_tokens, texts)
    reference, _ = _drive(llm, Pattern((False,)), "sync", params)
    switching = Pattern()
    got, preempted = _drive(llm, switching, "switch", params)
    overlapped, _ = _drive(llm, Pattern((True,)), "async", params)

    assert always_sync.counts[True] == 0
    assert switching.counts[True] > 10 and switching.counts[False] > 10
    assert preempted, "no request was preempted"
    finishes = {outs[-1][2] for i, outs in enumerate(reference) if i != ABORTED}
    assert finishes == {"stop", "length"}
    assert any(isinstance(outs[-1][3], str) for outs in reference)  # a stop string
    for i in range(NUM_REQUESTS):
        if i == ABORTED:  # aborted after a number of steps: a prefix of the tokens
            for run in (reference, got, overlapped):
                assert run[i][-1][2] in (None, "abort")
                assert _tokens(run[i]) == reference_tokens[i][: len(_tokens(run[i]))]
            continue
        assert got[i] == reference[i], f"request {i}"
        assert overlapped[i] == reference[i], f"request {i}"


def test_switching_ways_gives_the_synchronous_tokens_fast(async_tiny_llm: LLM) -> None:
    """The slow test's fast sibling: a few short requests, one stopping on a token."""
    llm = async_tiny_llm
    prompts = [{"prompt_token_ids": [9 + i, 40, 71 + 5 * i]} for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(4)]
    engine = llm.engine_client.engine  # type: ignore[attr-defined]

    def run(choice: OverlapChoice, params: list[SamplingParams]) -> list[tuple[list[int], Any]]:
        engine.overlap_choice = choice
        outputs = llm.generate(prompts, params)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]

    try:
        plain = run(Pattern((False,)), params)
        stop = plain[1][0][3]
        params[1] = SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[stop])
        switching = Pattern()
        got = run(switching, params)
        kept = plain[1][0].index(stop) + 1  # the synchronous tokens up to the stop token
        assert got == [plain[0], (plain[1][0][:kept], "stop"), *plain[2:]]
    finally:
        engine.overlap_choice = OverlapChoice(adaptive=True)
    assert switching.counts[True] >= 2 and switching.counts[False] >= 2


def test_ways_that_measure_alike_do_not_flap() -> None:
    clock = Clock()
    choice = OverlapChoice(adaptive=True, clock=clock)
    choice.completed(64, True)
    # The synchronous way 3% faster: within the margin, overlapping stays.
    ways = _run_steps(choice, clock, 64, {True: 0.001, False: 0.00097}, 4 * oc.PERIOD)
    assert ways.count(False) == 4 * oc.PROBE_STEPS
