"""The cache key of a constraint: its kind and its text, normalised."""

from __future__ import annotations

import json

from enginecore.params import StructuredOutputParams


def grammar_key(spec: StructuredOutputParams) -> tuple[str, str]:
    """``(kind, text)``; equal constraints written differently (key order) share a key."""
    if spec.json is not None:
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json, sort_keys=True)
        return "json", text
    if spec.json_object:
        return "json_object", ""
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "choice", json.dumps(spec.choice)
    if spec.structural_tag is not None:
        return "structural_tag", spec.structural_tag
    assert spec.grammar is not None  # StructuredOutputParams checks exactly one is set
    return "grammar", spec.grammar
