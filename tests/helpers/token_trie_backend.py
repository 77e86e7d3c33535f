"""A second, tiny structured-output backend, written only against the public interface.

It supports ``choice`` only: each choice is tokenized once and the grammar walks the
token sequences. What a third party plugging in another backend (outlines, ...) writes.
``gate`` lets a test hold compilation back; ``compiled`` counts real compiles.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

import enginecore
from enginecore.errors import InvalidRequestError
from enginecore.interfaces import StructuredOutputBackend, StructuredOutputGrammar
from enginecore.params import StructuredOutputParams


class TokenTrieGrammar(StructuredOutputGrammar):
    def __init__(self, sequences: list[list[int]], eos_token_ids: list[int]) -> None:
        self.sequences = sequences
        self.eos = set(eos_token_ids)
        self.tokens: list[int] = []
        self.done = False

    def _allowed(self) -> set[int]:
        n = len(self.tokens)
        live = [s for s in self.sequences if s[:n] == self.tokens]
        allowed = {s[n] for s in live if len(s) > n}
        if any(len(s) == n for s in live):
            allowed |= self.eos
        return allowed

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        saved = (list(self.tokens), self.done)
        for token in token_ids:
            if self.done or token not in self._allowed():
                self.tokens, self.done = saved
                return False
            self.tokens.append(token)
            self.done = token in self.eos
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens :]
        self.done = bool(self.tokens) and self.tokens[-1] in self.eos

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask.view(np.uint32)
        words[row] = 0
        for token in self._allowed():
            words[row, token >> 5] |= np.uint32(1 << (token & 31))

    def is_terminated(self) -> bool:
        return self.done


class TokenTrieBackend(StructuredOutputBackend):
    gate = threading.Event()
    compiled = 0

    @classmethod
    def validate(cls, spec: StructuredOutputParams) -> None:
        if spec.choice is None:
            raise InvalidRequestError("the token_trie backend supports only choice")

    def compile(self, spec: StructuredOutputParams) -> list[list[int]]:
        type(self).gate.wait(60)
        type(self).compiled += 1
        if "FAIL" in spec.choice:
            raise InvalidRequestError("the token_trie backend refuses 'FAIL'")
        return [self.tokenizer.encode(c, add_special_tokens=False) for c in spec.choice]

    def new_grammar(self, compiled: list[list[int]]) -> TokenTrieGrammar:
        return TokenTrieGrammar(compiled, self.eos_token_ids)


class TokenTriePlugin:
    """The plugin object: registers the backend through the public hook."""

    @enginecore.hookimpl
    def register_structured_output_backends(self, registry) -> None:
        registry.add("token_trie", TokenTrieBackend, summary="choices as token sequences")
