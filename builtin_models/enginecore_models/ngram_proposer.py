"""N-gram (prompt lookup) drafting: guess that text seen before in the request repeats.

The longest suffix of the request's tokens (between ``ngram_prompt_lookup_min`` and
``ngram_prompt_lookup_max`` tokens) that also occurs earlier is looked up, and the tokens
that followed its most recent earlier occurrence are proposed. This costs no model and
pays off where outputs copy their input: code edits, quoting, summaries, chat history.

The search is vectorised: one comparison of the whole context with the last token, then
each longer n-gram only filters the surviving candidate positions.
"""

from __future__ import annotations

import numpy as np

from enginecore.config import EngineConfig
from enginecore.interfaces import SpecDecodeProposer


class NgramProposer(SpecDecodeProposer):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        spec = config.speculative
        self.min_n = spec.ngram_prompt_lookup_min
        self.max_n = spec.ngram_prompt_lookup_max

    def propose(self, token_ids: np.ndarray, max_num_drafts: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_num_drafts <= 0 or num_tokens <= self.min_n:
            return []
        # Candidate end positions (inclusive) of earlier occurrences of the suffix: for
        # n = 1 every earlier position holding the last token.
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        best = ends if self.min_n <= 1 else None
        n = 1
        while ends.size and n < self.max_n:
            # Grow the n-gram by one token to the left; keep the candidates that agree.
            ends = ends[ends >= n]
            ends = ends[token_ids[ends - n] == token_ids[num_tokens - 1 - n]]
            n += 1
            if ends.size and n >= self.min_n:
                best = ends
        if best is None or not best.size:
            return []
        start = int(best[-1]) + 1  # after the most recent earlier occurrence
        drafts: list[int] = token_ids[start : start + max_num_drafts].tolist()
        return drafts
