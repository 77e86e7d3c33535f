"""Structured output on a random checkpoint: JSON schema, regex, choice, EBNF.

Fifty constrained requests share one batch with unconstrained ones, with async
scheduling on (engine in its own process) and off (in-process). Random weights loop on spaces,
so JSON is generated without free whitespace (``disable_any_whitespace``).
"""

from __future__ import annotations

import re
import time

import pytest

from enginecore import LLM, SamplingParams, StructuredOutputParams, make_config
from enginecore.engine.core import EngineCore
from enginecore.engine.input_processor import InputProcessor
from enginecore.engine.tokenizer import load_tokenizer
from enginecore.errors import InvalidRequestError, UnknownComponentError
from enginecore.plugins import make_plugin_manager
from enginecore.protocol import EngineCoreOutput, EngineCoreOutputs
from enginecore.request import FinishReason, RequestStatus
from enginecore.structured_output.manager import GrammarAdvance
from tests.helpers.structured import CHOICES, CODE_REGEX, PERSON_SCHEMA, check, mixed_batch
from tests.helpers.token_trie_backend import TokenTrieBackend, TokenTriePlugin


@pytest.fixture(scope="module", params=[True, False], ids=["async-mp", "sync-inproc"])
def llm(request, tiny_llama):
    # Async scheduling with the engine in its own process; sync in this process.
    with LLM(
        tiny_llama,
        dtype="float32",
        async_scheduling=request.param,
        multiprocessing=request.param,
        disable_any_whitespace=True,
        max_num_seqs=64,
    ) as llm:
        yield llm


def prompts(n: int) -> list[str]:
    return [f"request {i}: the answer is" for i in range(n)]


def test_fifty_constrained_requests_in_a_mixed_batch(llm):
    params = mixed_batch(50, 10)
    outputs = llm.generate(prompts(len(params)), params)
    free = [(i, p) for i, p in enumerate(params) if p.structured_output is None]
    assert len(free) == 10
    for p, out in zip(params, outputs, strict=True):
        completion = out.outputs[0]
        if p.structured_output is not None:
            assert completion.finish_reason == "stop", completion
            check(p.structured_output, completion.text)
    # The masks touch only their own rows: unconstrained requests come out as they do alone.
    alone = llm.generate([prompts(len(params))[i] for i, _ in free], [p for _, p in free])
    for (i, _), out in zip(free, alone, strict=True):
        assert outputs[i].outputs[0].token_ids == out.outputs[0].token_ids


def test_ebnf_grammar_greedy_and_sampled(llm):
    grammar = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]?'
    spec = StructuredOutputParams(grammar=grammar)
    params = [
        SamplingParams(max_tokens=20, temperature=t, seed=i, structured_output=spec)
        for i, t in enumerate((0.0, 1.0, 1.5))
    ]
    for out in llm.generate(prompts(3), params):
        assert re.fullmatch(r"(hello|hi) [a-z]{1,2}!", out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            StructuredOutputParams(json={"type": "objectx"}),
            'invalid JSON schema: Unsupported type "objectx"',
        ),
        (StructuredOutputParams(json="{not json"), "invalid JSON schema: Failed to parse JSON"),
        (StructuredOutputParams(regex="a(b"), "invalid regex: .*parenthesis is not closed"),
        (
            StructuredOutputParams(grammar='root ::= "a" | foo'),
            'invalid grammar: .*"foo" is not defined',
        ),
        (StructuredOutputParams(choice=[]), "choice needs a non-empty list"),
    ],
)
def test_invalid_constraint_is_refused_with_the_compilers_message(llm, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_output=spec))
    ok = llm.generate(
        "hi",
        SamplingParams(max_tokens=12, structured_output=StructuredOutputParams(choice=CHOICES)),
    )
    assert ok[0].outputs[0].text in CHOICES


def test_exactly_one_constraint_kind():
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputParams(regex="a", choice=["a"])


def test_unknown_backend_fails_at_startup_listing_the_available(tiny_llama):
    with pytest.raises(
        UnknownComponentError, match=r"'outlines'.*xgrammar \(from builtin_structured_output\)"
    ):
        LLM(tiny_llama, multiprocessing=False, structured_output_backend="outlines")


# --- a second backend, selected by config, through a real plugin hook ------------------------


@pytest.fixture(scope="module")
def trie_engine_module(tiny_llama):
    host = make_plugin_manager(load_entrypoints=False)
    assert host.register_object(TokenTriePlugin(), "token-trie").loaded
    config = make_config(
        model=str(tiny_llama),
        dtype="float32",
        multiprocessing=False,
        structured_output_backend="token_trie",
    )
    engine = EngineCore(config, host)
    tokenizer = load_tokenizer(config)
    processor = InputProcessor(config, tokenizer, engine.max_model_len, host)
    yield engine, processor, tokenizer
    TokenTrieBackend.gate.set()
    engine.shutdown()


@pytest.fixture()
def trie_engine(trie_engine_module):
    TokenTrieBackend.gate.set()
    TokenTrieBackend.compiled = 0
    yield trie_engine_module
    TokenTrieBackend.gate.set()


def _submit(engine, processor, request_id, params):
    request, _ = processor.process(request_id, "the weather today is", params)
    engine.add_request(request)


def _run(engine, until=None) -> dict[str, dict]:
    """Step like the engine process does (a short sleep when nothing could run)."""
    results: dict[str, dict] = {}
    step = engine.step_fn()
    deadline = time.monotonic() + 120  # a hang fails the test instead of stalling the suite
    while engine.has_work() and not (until is not None and until(results)):
        assert time.monotonic() < deadline, f"engine still busy; results so far: {results}"
        outputs, executed = step()
        if not outputs and not executed:
            time.sleep(0.001)
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                r = results.setdefault(
                    out.request_id, {"tokens": [], "finish": None, "error": None}
                )
                r["tokens"] += out.new_token_ids
                if out.finish_reason is not None:
                    r["finish"], r["error"] = out.finish_reason, out.error
    return results


def test_second_backend_is_selected_and_constrains(trie_engine):
    engine, processor, tokenizer = trie_engine
    choices = ["sunny", "rain and wind", "fog"]
    for i in range(4):
        params = SamplingParams(
            max_tokens=12,
            temperature=1.0,
            seed=i,
            structured_output=StructuredOutputParams(choice=choices),
        )
        _submit(engine, processor, f"c{i}", params)
    results = _run(engine)
    for i in range(4):
        tokens = results[f"c{i}"]["tokens"]
        assert tokenizer.decode(tokens, skip_special_tokens=True) in choices
    assert TokenTrieBackend.compiled == 1  # cached by the constraint's text
    # Its validate() runs in the frontend: what it does not support is refused there.
    with pytest.raises(InvalidRequestError, match="supports only choice"):
        processor.process(
            "r", "x", SamplingParams(structured_output=StructuredOutputParams(regex="a"))
        )


def test_plugin_grammar_with_ignore_eos_finishes_at_its_end(trie_engine):
    """A plugin backend's is_terminated() ends an ignore_eos request with stop: its
    output ends with the grammar's stop token, nothing after it; the plain one goes on."""
    engine, processor, tokenizer = trie_engine
    choices = ["sunny", "rain and wind", "fog"]
    spec = StructuredOutputParams(choice=choices)
    _submit(
        engine,
        processor,
        "g",
        SamplingParams(max_tokens=64, ignore_eos=True, structured_output=spec),
    )
    _submit(engine, processor, "p", SamplingParams(max_tokens=16, ignore_eos=True))
    results = _run(engine)
    grammar, plain = results["g"], results["p"]
    assert grammar["finish"] == FinishReason.STOP and grammar["error"] is None, grammar
    assert grammar["tokens"][-1] in engine.structured_output._get_backend().eos_token_ids
    assert tokenizer.decode(grammar["tokens"][:-1]) in choices
    assert plain["finish"] == FinishReason.LENGTH and len(plain["tokens"]) == 16


def test_tokens_after_the_grammars_end_in_one_step_are_dropped(trie_engine):
    """A scheduler that drafts for structured requests may bring tokens after the end in
    one step: the output stops at the end (logprobs too) and the request is finished."""
    engine, processor, _ = trie_engine
    spec = StructuredOutputParams(choice=["fog"])
    _submit(
        engine,
        processor,
        "e",
        SamplingParams(max_tokens=64, ignore_eos=True, structured_output=spec),
    )
    _run(engine, until=lambda results: "e" in results)  # running, one token sampled
    assert engine.scheduler.get_num_unfinished_requests() == 1
    output = EngineCoreOutput("e", [11, 12, 13], new_logprobs=[[-1.0], [-2.0], [-3.0]])
    outputs = {0: EngineCoreOutputs(outputs=[output])}
    engine._settle_grammars(outputs, GrammarAdvance(ended={"e": 2}))
    assert output.finish_reason == FinishReason.STOP
    assert output.new_token_ids == [11, 12] and output.new_logprobs == [[-1.0], [-2.0]]
    assert engine.scheduler.get_num_unfinished_requests() == 0  # finished, blocks freed
    assert "e" not in engine.structured_output.grammars


def test_request_waits_for_its_grammar_without_blocking_others(trie_engine):
    engine, processor, _ = trie_engine
    TokenTrieBackend.gate.clear()
    _submit(
        engine,
        processor,
        "slow",
        SamplingParams(max_tokens=8, structured_output=StructuredOutputParams(choice=["a b"])),
    )
    _submit(engine, processor, "free", SamplingParams(max_tokens=8, temperature=0.0))
    results = _run(engine, until=lambda r: r.get("free", {}).get("finish") is not None)
    assert results["free"]["finish"] is not None
    assert "slow" not in results
    assert engine.structured_output.waiting_ids() == ["slow"]
    assert engine.get_num_unfinished_requests() == 1
    TokenTrieBackend.gate.set()
    results = _run(engine)
    assert results["slow"]["finish"] is not None and results["slow"]["error"] is None


def test_abort_while_waiting_for_grammar(trie_engine):
    engine, processor, _ = trie_engine
    TokenTrieBackend.gate.clear()
    _submit(
        engine,
        processor,
        "w",
        SamplingParams(structured_output=StructuredOutputParams(choice=["x"])),
    )
    waiting = engine.structured_output._waiting["w"][0]
    assert waiting.status == RequestStatus.WAITING_FOR_GRAMMAR
    engine.abort_requests(["w"])
    assert waiting.status == RequestStatus.FINISHED_ABORTED
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_work()


def test_compile_error_in_the_engine_fails_only_that_request(trie_engine):
    engine, processor, _ = trie_engine
    _submit(
        engine,
        processor,
        "bad",
        SamplingParams(structured_output=StructuredOutputParams(choice=["FAIL"])),
    )
    _submit(engine, processor, "good", SamplingParams(max_tokens=6, temperature=0.0))
    results = _run(engine)
    assert str(results["bad"]["finish"]) == "error"
    # The backend's own words, then the plugin that raised them and the key that chose it.
    assert results["bad"]["error"] == (
        "the token_trie backend refuses 'FAIL' (structured output backend 'token_trie' from "
        "plugin 'token-trie' (distribution <object>), config key structured_output.backend)"
    )
    assert str(results["good"]["finish"]) == "length" and len(results["good"]["tokens"]) == 6


@pytest.mark.slow
def test_tensor_parallel_workers_get_the_bitmask(tiny_llama):
    """The bitmask crosses the ``mp`` executor's broadcast to two ranks."""
    with LLM(
        tiny_llama,
        dtype="float32",
        executor="mp",
        tensor_parallel_size=2,
        multiprocessing=False,
        disable_any_whitespace=True,
    ) as llm:
        params = mixed_batch(9, 3)
        outputs = llm.generate(prompts(len(params)), params)
        for p, out in zip(params, outputs, strict=True):
            if p.structured_output is not None:
                check(p.structured_output, out.outputs[0].text)


# A constrained request with ``ignore_eos`` ends when its grammar does: once the grammar has
# accepted its end-of-sequence token the structured output is complete, so the request
# finishes with ``stop`` exactly as it would without ``ignore_eos`` (same tokens, the end
# token not in the text), never with an error, and nothing sampled after the end (a step
# already in flight under async scheduling) is returned. A plain ``ignore_eos`` request in
# the same batch is untouched.
IGNORE_EOS_GRAMMAR = (
    'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]?'
)
IGNORE_EOS_SPECS = {
    "grammar": StructuredOutputParams(grammar=IGNORE_EOS_GRAMMAR),
    "json": StructuredOutputParams(json=PERSON_SCHEMA),
    "regex": StructuredOutputParams(regex=CODE_REGEX),
    "choice": StructuredOutputParams(choice=CHOICES),
}
IGNORE_EOS_PROMPTS = ["the plain one goes on", "the constrained one stops"]


@pytest.mark.parametrize("kind", sorted(IGNORE_EOS_SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_grammar_with_ignore_eos_stops_at_the_grammars_end(llm, kind, temperature):
    spec = IGNORE_EOS_SPECS[kind]
    constrained = SamplingParams(
        max_tokens=200, temperature=temperature, seed=7, ignore_eos=True, structured_output=spec
    )
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_out, out = llm.generate(IGNORE_EOS_PROMPTS, [plain, constrained])
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion
    if kind == "grammar":
        assert re.fullmatch(r"(hello|hi) [a-z]{1,2}!", completion.text), completion.text
    else:
        check(spec, completion.text)
    # The same request without ignore_eos: the same tokens, the same text.
    reference = llm.generate(IGNORE_EOS_PROMPTS[1:], [constrained.clone(ignore_eos=False)])
    expected = reference[0].outputs[0]
    assert expected.finish_reason == "stop", expected
    assert list(completion.token_ids) == list(expected.token_ids)
    assert completion.text == expected.text
    # The plain ignore_eos request runs to its length, as it does alone.
    assert plain_out.outputs[0].finish_reason == "length"
    assert len(plain_out.outputs[0].token_ids) == 24
    alone = llm.generate(IGNORE_EOS_PROMPTS[:1], [plain])[0].outputs[0]
    assert list(plain_out.outputs[0].token_ids) == list(alone.token_ids)
