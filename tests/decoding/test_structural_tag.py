"""Structural tags (vLLM's ``structural_tag``): text outside the tags is free; inside a tag
the content follows the tag's JSON schema. Checked on the compiled grammar (vLLM's
``structures``/``triggers`` form) and offline through ``LLM`` (xgrammar's form with
``at_least_one``, which makes a random model write a tag at once); the server's side is
in test_server_structured.py."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from enginecore import LLM, InvalidRequestError, SamplingParams, StructuredOutputParams
from enginecore.config import make_config
from enginecore_structured_output.xgrammar_backend import XgrammarBackend
from tests.helpers.structured import (
    FORCED_FORM,
    TAG,
    VLLM_FORM,
    assert_tags_valid,
)


@pytest.fixture(scope="module")
def backend(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    return XgrammarBackend(
        make_config(model=str(tiny_llama)),
        tokenizer=tokenizer,
        vocab_size=len(tokenizer),
        eos_token_ids=[tokenizer.eos_token_id],
    )


def _accepts(backend, spec: StructuredOutputParams, text: str) -> bool:
    matcher = xgr.GrammarMatcher(backend.compile(spec))
    return matcher.accept_string(text)


def test_vllm_form_frees_text_outside_tags_and_holds_tags_to_their_schema(backend):
    spec = StructuredOutputParams(structural_tag=json.dumps(VLLM_FORM))
    XgrammarBackend.validate(spec)
    good = 'Let me look. <tool=flag>{"on": true}</tool> and <tool=person>' + json.dumps(
        {"name": "ann", "age": 3, "member": False, "color": "red"}
    )
    assert _accepts(backend, spec, good + "</tool> done")
    assert _accepts(backend, spec, "no tags at all")
    assert not _accepts(backend, spec, '<tool=flag>{"on": 1}</tool>')
    assert not _accepts(backend, spec, '<tool=flag>{"on": true, "x": 1}</tool>')
    assert not _accepts(backend, spec, '<tool=other>{"on": true}</tool>')


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("not json", "not valid JSON"),
        ({"structures": []}, "triggers"),
        ({"structures": [], "triggers": ["<t"]}, "at least one structure"),
        (
            {"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}], "triggers": ["<t"]},
            "starts with none of the triggers",
        ),
        ({"structures": [{"begin": "<t>", "end": "</t>"}], "triggers": ["<t"]}, "schema"),
    ],
)
def test_bad_structural_tags_name_the_fault(tag, message):
    text = tag if isinstance(tag, str) else json.dumps(tag)
    with pytest.raises(InvalidRequestError, match=message):
        XgrammarBackend.validate(StructuredOutputParams(structural_tag=text))


@pytest.mark.slow
def test_llm_output_inside_the_tag_follows_its_schema(tiny_llama):
    spec = StructuredOutputParams(structural_tag=json.dumps(FORCED_FORM))
    params = [
        SamplingParams(max_tokens=80, structured_output=spec, temperature=t, seed=s)
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2))
    ]
    with LLM(tiny_llama, multiprocessing=False, disable_any_whitespace=True) as llm:
        outputs = llm.generate(["Call a tool."] * len(params), params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert TAG.fullmatch(completion.text), completion.text
        assert_tags_valid(completion.text)
