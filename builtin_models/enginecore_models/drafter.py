"""The model runner's side of speculative decoding: proposing drafts after each step.

The runner is the authority on a request's tokens, so drafts are proposed here, right
after sampling, from every token sampled so far. The scheduler learns them with the
step's output; with async scheduling it has already planned the next step with ``-1``
placeholder slots, which the runner fills from the drafts it keeps (``state.drafts``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from enginecore.config import EngineConfig
from enginecore.errors import PluginContractError
from enginecore.interfaces import SpecDecodeProposer, WorkerSpec
from enginecore.plugin_attribution import with_attribution
from enginecore.registry import import_ref
from enginecore.worker_component_errors import build_worker_component


class TokenBuffer:
    """A request's tokens as a growing int64 array (the proposer's input, no per-step copy)."""

    __slots__ = ("_array", "_size")

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.int64)
        self._size = 0

    def view(self, token_ids: list[int]) -> np.ndarray:
        """The first ``len(token_ids)`` tokens; only tokens appended since the last call
        are copied (``token_ids`` only ever grows)."""
        n = len(token_ids)
        if n > self._array.size:
            grown = np.empty(max(2 * self._array.size, n + 64), dtype=np.int64)
            grown[: self._size] = self._array[: self._size]
            self._array = grown
        if n > self._size:
            self._array[self._size : n] = token_ids[self._size : n]
        self._size = n
        out = self._array[:n]
        out.flags.writeable = False
        return out


class Drafter:
    """Builds the configured proposer and asks it for each request's next drafts."""

    def __init__(
        self, config: EngineConfig, proposer_ref: str, spec: WorkerSpec | None = None
    ) -> None:
        name = config.speculative.speculative_method or proposer_ref
        self.proposer: SpecDecodeProposer = build_worker_component(
            "spec_decode_proposer",
            lambda: import_ref(proposer_ref)(config),
            {name: proposer_ref},
            spec,
            name=name,
        )
        self.num_spec_tokens = config.speculative.num_speculative_tokens

    def propose(self, buffer: TokenBuffer, token_ids: list[int], vocab_size: int) -> list[int]:
        """The next drafts; :class:`PluginContractError` naming the proposer if they are
        malformed (the runner fails that request only)."""
        drafts = self.proposer.propose(buffer.view(token_ids), self.num_spec_tokens)
        return self._checked(drafts, vocab_size)

    def _checked(self, drafts: Any, vocab_size: int) -> list[int]:
        """The drafts as ints; anything but at most ``num_spec_tokens`` token ids of the
        vocabulary is named (a float would be truncated into some unrelated token, an id
        past the vocabulary would index past the embedding table)."""
        wrong = None
        if isinstance(drafts, np.ndarray) and drafts.ndim != 1:
            wrong = f"an array of shape {drafts.shape}"
        elif not isinstance(drafts, (list, tuple, np.ndarray)):
            wrong = repr(drafts)
        elif len(drafts) > self.num_spec_tokens:
            wrong = f"{len(drafts)} drafts where at most {self.num_spec_tokens} were asked for"
        else:
            for token in drafts:
                if not isinstance(token, (int, np.integer)) or isinstance(token, bool):
                    wrong = f"{token!r}, which is not a token id"
                    break
                if token < 0:
                    wrong = f"{token}, a negative token id"
                    break
                if token >= vocab_size:
                    wrong = f"{token}, past the vocabulary (token ids are 0..{vocab_size - 1})"
                    break
        if wrong is None:
            return [int(t) for t in drafts]
        method = type(self.proposer).propose
        text = (
            f"spec decode proposer {type(self.proposer).__qualname__}.propose returned "
            f"{wrong}; it must return at most max_num_drafts "
            f"({self.num_spec_tokens}) token ids of the model's vocabulary "
            "(config key speculative.speculative_method)"
        )
        # Named here: a worker's error reaches the frontend as text, origin lost.
        raise PluginContractError(
            with_attribution(PluginContractError(text, origin=method), text), origin=method
        )
