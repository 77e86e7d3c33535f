"""``sample_tokens``' greedy shortcut: a step whose every sampling row is plain greedy
takes the argmax and its one host copy, without sampling metadata; its tokens are the
general path's and transformers'. Rows that need more (logprobs, prompt logprobs,
penalties, logit bias, min_tokens, a seeded random sampler, a grammar, drafts) keep the
general path, alone or beside plain greedy rows.
"""

from __future__ import annotations

import random

import pytest

from enginecore import LLM, SamplingParams, StructuredOutputParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference

_RNG = random.Random(11)
PROMPTS = [[_RNG.randrange(10, 8000) for _ in range(_RNG.randint(2, 30))] for _ in range(5)]
LENGTHS = [_RNG.randint(4, 16) for _ in PROMPTS]
GRAMMAR = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]?'

# Each needs the general path on every step it samples in.
GENERAL = {
    "logprobs": dict(logprobs=2),
    "prompt_logprobs": dict(prompt_logprobs=1),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "frequency_penalty": dict(frequency_penalty=0.5),
    "logit_bias": dict(logit_bias={5: 3.0}),
    "min_tokens": dict(min_tokens=3),
    "seeded_random": dict(temperature=0.8, seed=7),
    "grammar": dict(structured_output=StructuredOutputParams(grammar=GRAMMAR)),
}


@pytest.fixture(scope="module")
def references(tiny_llama):
    return [greedy_reference(tiny_llama, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]


def _greedy(n: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, dtype="float32", multiprocessing=False, max_model_len=128) as llm:
        yield llm


def _runner(llm: LLM):
    return llm.engine_client.engine.executor.worker.model_runner


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_shortcut_matches_general_path_and_transformers(
    tiny_llama, references, async_scheduling
) -> None:
    params = [_greedy(n) for n in LENGTHS]
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        async_scheduling=async_scheduling,
        max_num_seqs=3,  # steps where requests join and leave as well as decode-only ones
        max_model_len=128,
    ) as llm:
        runner = _runner(llm)
        fused = runner.fused_decode  # on CPU: the argmax in the fused step where it has the head
        shortcut = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
        taken = runner.greedy_shortcut_steps
        in_call = getattr(fused, "token_steps", 0)
        runner.greedy_shortcut = False
        general = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
        assert runner.greedy_shortcut_steps == taken, "the switch did not turn it off"
        assert getattr(fused, "token_steps", 0) == in_call, "the switch left the fused argmax"
    assert taken >= max(LENGTHS), "the greedy steps did not take the shortcut"
    if fused is not None and fused.has_head:  # decode-only steps took the head's argmax
        assert in_call >= max(LENGTHS) // 2, in_call
    assert shortcut == general
    for i, reference in enumerate(references):
        assert_matches_reference(list(shortcut[i]), reference, f"request {i}")


@pytest.mark.parametrize("case", sorted(GENERAL))
def test_rows_needing_more_keep_the_general_path(llm, references, case) -> None:
    """The request alone, then beside a plain greedy one that finishes first: no step it
    samples in takes the shortcut, and the plain greedy tokens are unchanged."""
    runner = _runner(llm)
    n = LENGTHS[0]
    extra = GENERAL[case]
    special = SamplingParams(
        **{"max_tokens": n + 4, "temperature": 0.0, "ignore_eos": True, **extra}
    )
    before = runner.greedy_shortcut_steps
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], [special])[0].outputs[0]
    assert runner.greedy_shortcut_steps == before, f"{case} alone took the shortcut"
    if case == "grammar":  # ends with the grammar, maybe before the plain request ends
        assert alone.finish_reason == "stop", alone
        return
    out = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
        [_greedy(n), special],
    )
    assert runner.greedy_shortcut_steps == before, f"{case} beside greedy took the shortcut"
    assert_matches_reference(list(out[0].outputs[0].token_ids), references[0], case)


def test_spec_decode_keeps_its_path(tiny_llama) -> None:
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        max_model_len=128,
        speculative_method="ngram",
        num_speculative_tokens=3,
    ) as llm:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [_greedy(n) for n in LENGTHS])
        assert _runner(llm).greedy_shortcut_steps == 0


def test_fused_greedy_tokens_land_in_one_host_array(llm, references) -> None:
    """On CPU the fused step's head writes each greedy step's tokens into one host array
    the runner keeps: sampling reads them there, with no tensor made and no host copy
    per step, and they are still transformers' tokens."""
    from enginecore_cpu import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: no fused step")
    runner = _runner(llm)
    fused = runner.fused_decode
    assert fused is not None and fused.has_head, "the float32 Llama on CPU takes the fused head"
    fused_run, host_copy = fused.run, runner.host_copy
    addresses: list[int] = []
    copies: list[object] = []

    def run(ids, positions, batch, **head):
        out = fused_run(ids, positions, batch, **head)
        if head.get("head") == "tokens":
            addresses.append(out.data_ptr())
        return out

    def start(tensors):
        copies.append(tensors)
        return type(host_copy).start(host_copy, tensors)

    fused.run, host_copy.start = run, start
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], [_greedy(n) for n in LENGTHS]
        )
    finally:
        del fused.run, host_copy.start
    assert len(addresses) >= max(LENGTHS) // 2, "the decode steps did not take the fused head"
    assert len(set(addresses)) == 1, "each step's tokens went to a new tensor"
    assert copies == [], f"{len(copies)} host copies of tokens already in host memory"
    for i, (out, reference) in enumerate(zip(outs, references, strict=True)):
        assert_matches_reference(list(out.outputs[0].token_ids), reference, f"request {i}")
