"""Constraints and checks shared by the structured-output tests."""

from __future__ import annotations

import json
import re

import jsonschema

from enginecore import SamplingParams, StructuredOutputParams

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
