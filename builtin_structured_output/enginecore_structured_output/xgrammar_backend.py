"""The xgrammar backend: grammars compiled against the model's vocabulary, on CPU and CUDA.

The bitmask is filled on the CPU (in the engine core, while the forward pass runs); the
model runner applies it to the logits on whatever device they live.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import xgrammar as xgr

from enginecore.config import EngineConfig
from enginecore.errors import InvalidRequestError
from enginecore.interfaces import StructuredOutputBackend, StructuredOutputGrammar
from enginecore.params import StructuredOutputParams

# xgrammar's errors start with a timestamp, a C++ source location and sometimes the
# failed check's text: users need only the message after them.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_ANY_JSON_OBJECT = '{"type": "object"}'


def compiler_message(exc: BaseException) -> str:
    return _NATIVE_PREFIX.sub("", str(exc).strip()).strip()


def _json_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON escapes are EBNF escapes)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("choice needs a non-empty list of strings")
    if any(not c for c in choices):
        raise InvalidRequestError("choice strings must be non-empty")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structural_tag(text: str) -> dict[str, Any]:
    """vLLM's structural tag JSON as xgrammar's: the ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`` form becomes a ``triggered_tags`` format (text is free
    until a trigger, then one tag whose content follows its schema); the
    ``{"type": "structural_tag", "format": ...}`` form is xgrammar's own, passed as is."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"structural_tag is not valid JSON: {exc}") from None
    if isinstance(spec, dict) and "format" in spec:
        return spec
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list):
        raise InvalidRequestError(
            'structural_tag needs "structures" (a list of {"begin", "schema", "end"}) and '
            '"triggers", or xgrammar\'s {"type": "structural_tag", "format": ...}'
        )
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequestError('structural_tag needs "triggers": a list of non-empty strings')
    tags = []
    for i, item in enumerate(spec["structures"]):
        if not isinstance(item, dict) or not all(
            isinstance(item.get(key), str) for key in ("begin", "end")
        ):
            raise InvalidRequestError(f"structural_tag structures[{i}] needs string begin and end")
        schema = item.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"structural_tag structures[{i}].schema must be an object")
        if not any(item["begin"].startswith(t) for t in triggers):
            raise InvalidRequestError(
                f"structural_tag structures[{i}].begin {item['begin']!r} starts with none of "
                f"the triggers {triggers}"
            )
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": item["begin"], "content": content, "end": item["end"]})
    if not tags:
        raise InvalidRequestError("structural_tag needs at least one structure")
    triggered = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return {"type": "structural_tag", "format": triggered}


def compact_json_contents(node: Any) -> Any:
    """``node`` (a structural tag) with each JSON-schema content (standard JSON style) as
    the schema's grammar without free whitespace: ``disable_any_whitespace`` holds inside
    the tags too (xgrammar's structural tags have no whitespace option of their own)."""
    if isinstance(node, list):
        return [compact_json_contents(item) for item in node]
    if not isinstance(node, dict):
        return node
    json_style = node.get("type") == "json_schema" and node.get("style", "json") == "json"
    if json_style and "json_schema" in node:
        grammar = xgr.Grammar.from_json_schema(
            _json_text(node["json_schema"]), any_whitespace=False
        )
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: compact_json_contents(value) for key, value in node.items()}


def _kind(spec: StructuredOutputParams) -> str:
    if spec.structural_tag is not None:
        return "structural_tag"
    if spec.json is not None:
        return "JSON schema"
    if spec.regex is not None:
        return "regex"
    if spec.grammar is not None:
        return "grammar"
    return "choice" if spec.choice is not None else "JSON object"


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar matcher."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        matcher = self.matcher
        for n, token in enumerate(token_ids):
            if not matcher.accept_token(token):
                if n:
                    matcher.rollback(n)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """JSON schema, any JSON object, regex, choice, EBNF (xgrammar's GBNF dialect) and
    structural tags."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        super().__init__(
            config, tokenizer=tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids
        )
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        # The engine caches compiled grammars by their text; xgrammar need not cache too.
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.any_whitespace = not config.structured_output.disable_any_whitespace

    @classmethod
    def validate(cls, spec: StructuredOutputParams) -> None:
        """Parse the constraint without a tokenizer (cheap), so errors are a 400 at once."""
        try:
            if spec.json is not None:
                xgr.Grammar.from_json_schema(_json_text(spec.json))
            elif spec.regex is not None:
                xgr.Grammar.from_regex(spec.regex)
            elif spec.choice is not None:
                xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
            elif spec.grammar is not None:
                xgr.Grammar.from_ebnf(spec.grammar)
            elif spec.structural_tag is not None:
                xgr.Grammar.from_structural_tag(structural_tag(spec.structural_tag))
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise InvalidRequestError(f"invalid {_kind(spec)}: {compiler_message(exc)}") from None

    def compile(self, spec: StructuredOutputParams) -> xgr.CompiledGrammar:
        compiler = self.compiler
        try:
            if spec.json is not None:
                return compiler.compile_json_schema(
                    _json_text(spec.json), any_whitespace=self.any_whitespace
                )
            if spec.json_object:
                return compiler.compile_json_schema(
                    _ANY_JSON_OBJECT, any_whitespace=self.any_whitespace, strict_mode=False
                )
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if spec.structural_tag is not None:
                tag = structural_tag(spec.structural_tag)
                if not self.any_whitespace:
                    tag = compact_json_contents(tag)
                return compiler.compile_structural_tag(tag)
            if spec.grammar is None:
                raise InvalidRequestError("structured output names no constraint")
            return compiler.compile_grammar(spec.grammar)
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise InvalidRequestError(f"invalid {_kind(spec)}: {compiler_message(exc)}") from None

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
