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


def _kind(spec: StructuredOutputParams) -> str:
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
    """JSON schema, any JSON object, regex, choice and EBNF (xgrammar's GBNF dialect)."""

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
            return compiler.compile_grammar(spec.grammar)
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise InvalidRequestError(f"invalid {_kind(spec)}: {compiler_message(exc)}") from None

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
