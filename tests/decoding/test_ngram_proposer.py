"""The n-gram (prompt lookup) proposer against a brute-force reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from enginecore import make_config
from enginecore.errors import ConfigError
from enginecore.plugins import make_plugin_manager
from enginecore.testing import SpecDecodeProposerContract
from enginecore_models.drafter import Drafter, TokenBuffer
from enginecore_models.ngram_proposer import NgramProposer


def proposer(lo: int = 1, hi: int = 4) -> NgramProposer:
    config = make_config(
        speculative_method="ngram",
        num_speculative_tokens=3,
        ngram_prompt_lookup_min=lo,
        ngram_prompt_lookup_max=hi,
    )
    return NgramProposer(config)


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest suffix n-gram (lo..hi) seen earlier; continue its latest earlier occurrence."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(p: NgramProposer, tokens: list[int], k: int = 3) -> list[int]:
    return p.propose(np.array(tokens, dtype=np.int64), k)


def test_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    p = proposer()
    # "5 6" occurs twice earlier; the 3-gram "4 5 6" only once, followed by 7 8 9.
    assert propose(p, [4, 5, 6, 7, 8, 9, 1, 5, 6, 2, 3, 4, 5, 6]) == [7, 8, 9]
    # Only the 2-gram matches: its latest earlier occurrence wins.
    assert propose(p, [5, 6, 7, 1, 5, 6, 2, 9, 5, 6]) == [2, 9, 5]
    # The continuation may run into the suffix itself (a loop), and ends with the text.
    assert propose(p, [1, 2, 1, 2, 1, 2]) == [1, 2]
    assert propose(p, [1, 2, 3, 1], k=5) == [2, 3, 1]  # fewer tokens than asked
    assert propose(p, [1, 2, 3, 4]) == []  # the last token never occurred before
    assert propose(p, [7]) == []
    assert propose(p, [7, 7], k=0) == []


def test_min_and_max_ngram_bounds() -> None:
    tokens = [9, 1, 2, 8, 3, 1, 2]
    assert propose(proposer(lo=1, hi=4), tokens) == [8, 3, 1]
    assert propose(proposer(lo=3, hi=4), tokens) == []  # "1 2" is too short a match
    # hi caps the n-gram: the 2-gram "3 4" follows only its latest occurrence.
    tokens = [1, 3, 4, 5, 2, 3, 4, 6, 1, 3, 4]
    assert propose(proposer(lo=1, hi=3), tokens) == [5, 2, 3]
    assert propose(proposer(lo=1, hi=2), tokens) == [6, 1, 3]


@pytest.mark.parametrize("lo, hi", [(1, 4), (2, 3), (1, 1), (3, 6)])
def test_matches_the_brute_force_reference(lo: int, hi: int) -> None:
    rng = random.Random(lo * 10 + hi)
    p = proposer(lo, hi)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        k = rng.randrange(1, 6)
        assert propose(p, tokens, k) == brute_force(tokens, lo, hi, k), (tokens, k)


def test_token_buffer_copies_only_what_was_appended() -> None:
    buffer = TokenBuffer()
    tokens = list(range(100))
    view = buffer.view(tokens)
    assert view.tolist() == tokens and not view.flags.writeable
    tokens += [7] * 500
    assert buffer.view(tokens).tolist() == tokens


def test_the_builtin_is_registered_and_bad_settings_are_refused() -> None:
    registry = make_plugin_manager(load_entrypoints=False).registry("spec_decode_proposer")
    entry = registry.entry("ngram")
    assert entry.plugin == "builtin_models"
    config = make_config(speculative_method="ngram", num_speculative_tokens=2)
    drafter = Drafter(config, entry.ref)
    assert drafter.propose(TokenBuffer(), [1, 2, 3, 1, 2, 3, 1], vocab_size=100) == [2, 3]
    with pytest.raises(ConfigError, match="needs num_speculative_tokens >= 1"):
        make_config(speculative_method="ngram")
    with pytest.raises(ConfigError, match="ngram_prompt_lookup_max must be >="):
        make_config(ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="num_speculative_tokens must be >= 0"):
        make_config(num_speculative_tokens=-1)


class TestNgramProposerContract(SpecDecodeProposerContract):
    proposer = "ngram"

    @pytest.fixture(scope="class")
    def contract_checkpoint(self, tiny_llama):
        return tiny_llama
