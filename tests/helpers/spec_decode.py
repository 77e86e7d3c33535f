"""Run the real engine core in-process and collect tokens, logprobs and stats per request."""

from __future__ import annotations

import math
import pathlib
import random
from dataclasses import dataclass, field

from enginecore import SamplingParams, make_config
from enginecore.engine.core import EngineCore
from enginecore.protocol import EngineCoreRequest


@dataclass
class EngineRun:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[list[float]]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    tokens_per_step: dict[str, list[int]] = field(default_factory=dict)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_preemptions: int = 0
    leaks: list[str] = field(default_factory=list)

    def in_order(self) -> list[list[int]]:
        return [self.tokens[str(i)] for i in range(len(self.tokens))]


def run_engine(
    path: str | pathlib.Path,
    requests: list[tuple[list[int], SamplingParams]],
    *,
    eos_token_id: int | None = None,
    **overrides: object,
) -> EngineRun:
    """Add every request to a real EngineCore, step its configured loop until idle."""
    settings: dict[str, object] = dict(
        model=str(path), dtype="float32", multiprocessing=False, num_blocks_override=256
    )
    settings.update(overrides)
    engine = EngineCore(make_config(**settings))
    run = EngineRun()
    try:
        for i, (prompt, params) in enumerate(requests):
            run.tokens[str(i)] = []
            run.logprobs[str(i)] = []
            run.tokens_per_step[str(i)] = []
            engine.add_request(
                EngineCoreRequest(
                    request_id=str(i),
                    prompt_token_ids=list(prompt),
                    sampling_params=params,
                    arrival_time=0.0,
                    eos_token_id=eos_token_id,
                )
            )
        step = engine.step_fn()
        while engine.has_work():
            outputs, _ = step()
            for client_outputs in outputs.values():
                stats = client_outputs.scheduler_stats
                if stats is not None:
                    run.spec_num_drafts += stats.spec_num_drafts
                    run.spec_num_draft_tokens += stats.spec_num_draft_tokens
                    run.spec_num_accepted_tokens += stats.spec_num_accepted_tokens
                    run.num_preemptions += stats.num_preemptions
                for out in client_outputs.outputs:
                    run.tokens[out.request_id].extend(out.new_token_ids)
                    run.tokens_per_step[out.request_id].append(len(out.new_token_ids))
                    if out.new_logprobs:
                        assert len(out.new_logprobs) == len(out.new_token_ids)
                        run.logprobs[out.request_id].extend(out.new_logprobs)
                    if out.finish_reason is not None:
                        run.finish_reasons[out.request_id] = str(out.finish_reason)
        run.leaks = engine.scheduler.leak_report()
    finally:
        engine.shutdown()
    return run


def repetitive_prompt(rng: random.Random, period: int, repeats: int, vocab: int) -> list[int]:
    """Text that repeats itself: where the n-gram proposer finds its drafts."""
    unit = [rng.randrange(10, vocab) for _ in range(period)]
    return unit * repeats + unit[: period // 2]


def mixed_spec_prompts(seed: int = 0, vocab: int = 8192) -> list[list[int]]:
    """Self-repeating prompts interleaved with random ones of many lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(12):
        if i % 2 == 0:
            prompts.append(repetitive_prompt(rng, 3 + i, 3 + i % 3, vocab))
        else:
            prompts.append([rng.randrange(10, vocab) for _ in range(4 + 7 * i)])
    return prompts


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) (Wilson-Hilferty); z = 3.719 is alpha = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def two_sample_chi_square(a: dict, b: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Homogeneity statistic of two count tables and its degrees of freedom. Categories
    too rare for the approximation are pooled into one."""
    n_a, n_b = sum(a.values()), sum(b.values())
    pooled_a = pooled_b = 0
    stat, cells = 0.0, 0
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        if (x + y) * min(n_a, n_b) / (n_a + n_b) < min_expected:
            pooled_a += x
            pooled_b += y
            continue
        stat += _cell(x, y, n_a, n_b)
        cells += 1
    if pooled_a + pooled_b:
        stat += _cell(pooled_a, pooled_b, n_a, n_b)
        cells += 1
    return stat, max(cells - 1, 1)


def _cell(x: int, y: int, n_a: int, n_b: int) -> float:
    total = x + y
    e_a = total * n_a / (n_a + n_b)
    e_b = total * n_b / (n_a + n_b)
    return (x - e_a) ** 2 / e_a + (y - e_b) ** 2 / e_b
