"""A constrained request with ``ignore_eos`` ends when its grammar does.

Once the grammar has accepted its end-of-sequence token the structured output is
complete: the request finishes with ``stop`` exactly as it would without ``ignore_eos``
(same tokens, the end token not in the text), never with an error, and nothing sampled
after the end (a step already in flight under async scheduling) is returned. A plain
``ignore_eos`` request in the same batch is untouched.
"""

from __future__ import annotations

import re

import pytest

from enginecore import LLM, SamplingParams, StructuredOutputParams
from tests.helpers.structured import CHOICES, CODE_REGEX, PERSON_SCHEMA, check

GRAMMAR = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]?'
SPECS = {
    "grammar": StructuredOutputParams(grammar=GRAMMAR),
    "json": StructuredOutputParams(json=PERSON_SCHEMA),
    "regex": StructuredOutputParams(regex=CODE_REGEX),
    "choice": StructuredOutputParams(choice=CHOICES),
}
PROMPTS = ["the plain one goes on", "the constrained one stops"]


@pytest.fixture(scope="module", params=[True, False], ids=["async-mp", "sync-inproc"])
def llm(request, tiny_llama):
    # Async scheduling with the engine in its own process; sync in this process.
    with LLM(
        tiny_llama,
        dtype="float32",
        async_scheduling=request.param,
        multiprocessing=request.param,
        disable_any_whitespace=True,
    ) as llm:
        yield llm


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_grammar_with_ignore_eos_stops_at_the_grammars_end(llm, kind, temperature):
    spec = SPECS[kind]
    constrained = SamplingParams(
        max_tokens=200, temperature=temperature, seed=7, ignore_eos=True, structured_output=spec
    )
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_out, out = llm.generate(PROMPTS, [plain, constrained])
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion
    if kind == "grammar":
        assert re.fullmatch(r"(hello|hi) [a-z]{1,2}!", completion.text), completion.text
    else:
        check(spec, completion.text)
    # The same request without ignore_eos: the same tokens, the same text.
    reference = llm.generate(PROMPTS[1:], [constrained.clone(ignore_eos=False)])
    expected = reference[0].outputs[0]
    assert expected.finish_reason == "stop", expected
    assert list(completion.token_ids) == list(expected.token_ids)
    assert completion.text == expected.text
    # The plain ignore_eos request runs to its length, as it does alone.
    assert plain_out.outputs[0].finish_reason == "length"
    assert len(plain_out.outputs[0].token_ids) == 24
    alone = llm.generate(PROMPTS[:1], [plain])[0].outputs[0]
    assert list(plain_out.outputs[0].token_ids) == list(alone.token_ids)
