"""Constraints and checks shared by the structured-output tests."""

from __future__ import annotations

import json
import re

import jsonschema

from enginecore import LLM, SamplingParams, StructuredOutputParams

# Bounded so that even a random model completes it within max_tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}
CODE_REGEX = r"[A-Z]{2}-\d{3}(\.[a-z]{1,4})?"
CHOICES = ["yes", "no", "it depends", 'say "hi"']


def constraint(i: int) -> StructuredOutputParams:
    """Request ``i``'s constraint: a JSON schema, a regex or a choice, in turn."""
    kind = i % 3
    if kind == 0:
        return StructuredOutputParams(json=PERSON_SCHEMA)
    if kind == 1:
        return StructuredOutputParams(regex=CODE_REGEX)
    return StructuredOutputParams(choice=CHOICES)


def check(spec: StructuredOutputParams, text: str) -> None:
    """The output obeys its constraint (AssertionError naming the output otherwise)."""
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), f"{text!r} does not match {spec.regex!r}"
    elif spec.choice is not None:
        assert text in spec.choice, f"{text!r} is not one of {spec.choice}"
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text


def _sampling(i: int) -> dict:
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}


def mixed_batch(num_constrained: int, num_free: int, max_tokens: int = 64) -> list[SamplingParams]:
    """Constrained requests with unconstrained ones spread among them; half greedy, half sampled."""
    params = [
        SamplingParams(max_tokens=max_tokens, structured_output=constraint(i), **_sampling(i))
        for i in range(num_constrained)
    ]
    for j in range(num_free):
        position = (j + 1) * len(params) // (num_free + 1)
        params.insert(position, SamplingParams(max_tokens=16, **_sampling(j)))
    return params


def run_mixed_batch(llm: LLM, num_constrained: int, num_free: int) -> None:
    params = mixed_batch(num_constrained, num_free)
    outputs = llm.generate(chat_prompts(llm, len(params)), params)
    assert sum(p.structured_output is None for p in params) == num_free
    for p, out in zip(params, outputs, strict=True):
        if p.structured_output is not None:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0]
            check(p.structured_output, out.outputs[0].text)


FLAG_SCHEMA = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}},
    "required": ["on"],
    "additionalProperties": False,
}


SCHEMAS = {"person": PERSON_SCHEMA, "flag": FLAG_SCHEMA}


TAG = re.compile(r"<tool=(\w+)>(.*?)</tool>", re.DOTALL)


VLLM_FORM = {
    "structures": [
        {"begin": f"<tool={name}>", "schema": schema, "end": "</tool>"}
        for name, schema in SCHEMAS.items()
    ],
    "triggers": ["<tool="],
}


#: xgrammar's form of the same tags, with a tag required at once and the output ending
#: after it (so that even random weights produce one to check).
FORCED_FORM = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<tool="],
        "tags": [
            {
                "type": "tag",
                "begin": f"<tool={name}>",
                "content": {"type": "json_schema", "json_schema": schema},
                "end": "</tool>",
            }
            for name, schema in SCHEMAS.items()
        ],
        "at_least_one": True,
        "stop_after_first": True,
    },
}


def assert_tags_valid(text: str, at_least: int = 1) -> None:
    """Each complete tag's content parses and follows its tag's schema."""
    found = TAG.findall(text)
    assert len(found) >= at_least, text
    for name, content in found:
        jsonschema.validate(json.loads(content), SCHEMAS[name])


def chat_prompts(llm: LLM, n: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} in JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]
