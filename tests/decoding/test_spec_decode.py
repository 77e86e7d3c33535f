"""Speculative decoding changes the speed, never the output.

The real engine core (scheduler, torch runner, sampler) runs the same requests with
n-gram speculation off and on: greedy output is token-for-token the same across a mixed
batch (self-repeating prompts where the proposer hits, random ones where it does not,
chunked prefill, prefix caching, preemption, sync and async scheduling) and equal to
transformers; seeded sampling, penalties, logit bias, logprobs and every stop condition
behave the same; and the sampled distribution at temperature 1 is the same.
"""

from __future__ import annotations

import collections
import random

import pytest

from enginecore import SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.spec_decode import (
    chi_square_critical,
    mixed_spec_prompts,
    repetitive_prompt,
    run_engine,
    two_sample_chi_square,
)

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LOOPS = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@LOOPS
def test_greedy_output_is_the_same_with_speculation(tiny_llama, async_scheduling) -> None:
    prompts = mixed_spec_prompts()
    common = dict(
        async_scheduling=async_scheduling,
        max_num_batched_tokens=32,  # long prompts are chunked
        prefix_caching=True,
        num_blocks_override=24,  # 23 usable blocks for ~40 blocks of demand: preemption
    )
    base = run_engine(tiny_llama, [(p, GREEDY) for p in prompts], **common)
    spec = run_engine(tiny_llama, [(p, GREEDY) for p in prompts], **common, **SPEC)
    assert spec.in_order() == base.in_order()
    assert all(len(t) == GREEDY.max_tokens for t in spec.in_order())
    assert set(spec.finish_reasons.values()) == {"length"}
    # The proposer hit and drafts were accepted; the batch really was under pressure.
    assert 0 < spec.spec_num_accepted_tokens <= spec.spec_num_draft_tokens
    assert spec.spec_num_drafts <= spec.spec_num_draft_tokens <= 3 * spec.spec_num_drafts
    assert max(max(n) for n in spec.tokens_per_step.values()) > 1
    assert spec.num_preemptions > 0
    assert base.spec_num_drafts == 0
    assert base.leaks == [] and spec.leaks == []


def test_speculative_greedy_matches_transformers(tiny_llama) -> None:
    prompts = mixed_spec_prompts(seed=5)[:4]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = run_engine(tiny_llama, [(p, params) for p in prompts], **SPEC)
    assert spec.spec_num_accepted_tokens > 0
    for i, (prompt, ours) in enumerate(zip(prompts, spec.in_order(), strict=True)):
        assert_matches_reference(ours, greedy_reference(tiny_llama, prompt, 16), f"prompt {i}")


def _feature_params(vocab_hint: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, min_p=0.02, seed=12),
        SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=0.6, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, seed=13, logprobs=0, ignore_eos=True),
        SamplingParams(
            max_tokens=20, temperature=0.0, logit_bias={vocab_hint: 3.0}, ignore_eos=True
        ),
    ]


@LOOPS
def test_sampling_features_are_unchanged_by_speculation(tiny_llama, async_scheduling) -> None:
    prompts = mixed_spec_prompts(seed=3)[:8]
    params = _feature_params(prompts[0][0])
    requests = list(zip(prompts, params, strict=True))
    base = run_engine(tiny_llama, requests, async_scheduling=async_scheduling)
    spec = run_engine(tiny_llama, requests, async_scheduling=async_scheduling, **SPEC)
    assert spec.spec_num_accepted_tokens > 0
    for i in map(str, range(len(requests))):
        assert spec.tokens[i] == base.tokens[i], f"request {i} ({params[int(i)]})"
        assert spec.finish_reasons[i] == base.finish_reasons[i]
        assert len(spec.logprobs[i]) == len(base.logprobs[i])
        for ours, theirs in zip(spec.logprobs[i], base.logprobs[i], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-3)
    assert len(spec.logprobs["5"]) == 20 and len(spec.logprobs["5"][0]) == 4  # sampled + top-3
    # Seeded requests are reproducible token for token, not just in distribution.
    assert spec.tokens["0"] != spec.tokens["1"]


def _first_occurrence_between(tokens: list[int], lo: int, hi: int) -> int:
    for index in range(lo, hi):
        if tokens.index(tokens[index]) == index:
            return index
    raise AssertionError(f"no token first appears at {lo}..{hi} in {tokens}")


@LOOPS
def test_stops_inside_an_accepted_run(tiny_llama, async_scheduling) -> None:
    """EOS, a stop token or max_tokens in the middle of a multi-token step ends the request
    right there; min_tokens holds stop tokens back exactly as without speculation."""
    rng = random.Random(8)
    prompt = repetitive_prompt(rng, 5, 4, 8192)
    free = run_engine(tiny_llama, [(prompt, SamplingParams(max_tokens=40, temperature=0.0))])
    tokens = free.tokens["0"]
    stop_at = _first_occurrence_between(tokens, 6, 40)
    stop = tokens[stop_at]
    requests = [
        (prompt, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop])),
        (prompt, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
        (
            prompt,
            SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], min_tokens=30),
        ),
        (prompt, SamplingParams(max_tokens=40, temperature=0.0)),  # EOS = the stop token
    ]
    kw = dict(async_scheduling=async_scheduling, eos_token_id=stop)
    base = run_engine(tiny_llama, requests, **kw)
    spec = run_engine(tiny_llama, requests, **kw, **SPEC)
    assert spec.tokens == base.tokens and spec.finish_reasons == base.finish_reasons
    assert spec.tokens["0"] == tokens[: stop_at + 1] and spec.finish_reasons["0"] == "stop"
    assert spec.tokens["1"] == tokens[:7] and spec.finish_reasons["1"] == "length"
    assert len(spec.tokens["2"]) >= 30
    assert spec.tokens["3"] == tokens[: stop_at + 1] and spec.finish_reasons["3"] == "stop"
    # The final step of the stopped requests carried several tokens (accepted drafts).
    assert spec.tokens_per_step["0"][-1] > 1 or spec.tokens_per_step["3"][-1] > 1
    assert spec.leaks == []


def test_sampled_distribution_is_the_same_with_speculation(tiny_llama) -> None:
    """Temperature 1, many unseeded samples: the joint distribution of the first four
    tokens is the same with speculation on (two-sample chi-square at alpha = 1e-4).

    A logit bias puts most of the mass on two tokens that the prompt alternates, so the
    n-gram proposer's drafts are accepted about half of the time: the accept path and
    the reject path (and the bonus token) each run thousands of times.
    """
    rng = random.Random(21)
    unit = [rng.randrange(10, 8192) for _ in range(2)]
    prompt = unit * 5
    bias = {token: 10.0 for token in unit}
    params = SamplingParams(max_tokens=4, temperature=1.0, logit_bias=bias, ignore_eos=True)
    n = 1000
    requests = [(prompt, params)] * n
    common = dict(max_num_seqs=256, num_blocks_override=1024, max_num_batched_tokens=4096)
    base = run_engine(tiny_llama, requests, **common)
    spec = run_engine(tiny_llama, requests, **common, **SPEC)

    def table(run) -> collections.Counter:
        return collections.Counter(
            tuple(t if t in bias else -1 for t in tokens) for tokens in run.in_order()
        )

    acceptance = spec.spec_num_accepted_tokens / spec.spec_num_draft_tokens
    assert 0.2 < acceptance < 0.8, acceptance
    assert spec.spec_num_draft_tokens > 1.5 * n  # most requests verified two drafts
    stat, df = two_sample_chi_square(table(base), table(spec))
    assert df > 20
    assert stat < chi_square_critical(df), (stat, df, table(base), table(spec))


def test_stop_strings_inside_a_multi_token_step_in_the_frontend(tiny_llama) -> None:
    """The frontend checks stop strings token by token within a multi-token step: the
    tokens after the one that completes the stop string are dropped (with their
    logprobs), exactly as when the same tokens arrive one step at a time."""
    from transformers import AutoTokenizer

    from enginecore.engine.output import OutputKind, RequestState
    from enginecore.protocol import EngineCoreOutput

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokens = tokenizer.encode(" alpha beta gamma delta epsilon zeta", add_special_tokens=False)
    text = tokenizer.decode(tokens)
    stop = "mma de"  # completed by a token in the middle of the step
    params = SamplingParams(max_tokens=40, stop=[stop], logprobs=0)

    def output(ids: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id="r",
            new_token_ids=ids,
            new_logprob_token_ids=[[t] for t in ids],
            new_logprobs=[[-0.5] for _ in ids],
            new_sampled_ranks=[1 for _ in ids],
        )

    def state() -> RequestState:
        return RequestState("r", None, [1], params, tokenizer, output_kind=OutputKind.FINAL_ONLY)

    one_by_one = state()
    for token in tokens:
        if one_by_one.apply(output([token]), 0.0) is not None:
            break
    at_once = state()
    assert at_once.apply(output(tokens), 0.0) == stop
    assert one_by_one.finish_reason is not None and at_once.finish_reason is not None
    assert at_once.text == one_by_one.text == text[: text.index(stop)]
    assert at_once.token_ids == one_by_one.token_ids
    assert 1 < len(at_once.token_ids) < len(tokens)
    assert len(at_once.logprobs) == len(at_once.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"]
)
def test_speculation_with_two_ranks(tiny_llama, parallel) -> None:
    """Every rank proposes for itself and learns the verified tokens from the output rank:
    greedy and seeded outputs equal the single-rank engine without speculation."""
    from enginecore import LLM

    prompts = _ids(mixed_spec_prompts()[:6])
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    params = [GREEDY.clone(max_tokens=16, logprobs=2)] * 6 + [seeded] * 6
    common = dict(dtype="float32", num_blocks_override=256, max_model_len=2048)
    with LLM(tiny_llama, multiprocessing=False, **common) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts * 2, params)]
    with LLM(tiny_llama, **common, **parallel, **SPEC) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts * 2, params)]
    assert outputs == reference


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]
