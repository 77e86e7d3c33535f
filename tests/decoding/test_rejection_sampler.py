"""Draft verification against exact probabilities, many samples over a small vocabulary.

Each position of a synthetic "model" has its own distribution ``p_j`` over 8 tokens.
With drafts ``d1..d3`` the emitted sequence must be ``t0..ta`` with independent
``tj ~ p_j`` and ``a`` the first position whose sample differs from its draft. Every
possible output has an exact probability, so 20 000 verified requests are tested with
a one-sample chi-square (alpha = 1e-4): an implementation that accepts too often, draws
the replacement token from the wrong position or the wrong distribution, or skips the
bonus token fails by a wide margin.
"""

from __future__ import annotations

import collections

import pytest
import torch

from enginecore import SamplingParams
from enginecore_models.rejection_sampler import SeededStreams, accept, expand_rows
from enginecore_models.sampler import Sampler, build_sampling_metadata
from tests.helpers.spec_decode import chi_square_critical

VOCAB = 8
DRAFTS = [3, 5, 3]
# One row per verified position (last known token, then each draft).
LOGITS = torch.tensor(
    [
        [0.5, 1.0, -0.2, 1.6, 0.0, 0.3, -1.0, 0.8],
        [0.1, -0.4, 0.9, 0.2, 0.4, 1.7, 0.0, -0.3],
        [1.2, 0.3, 0.0, 1.4, -0.6, 0.2, 0.5, 0.1],
        [-0.2, 0.7, 0.3, 0.0, 1.1, -0.5, 0.9, 0.4],
    ]
)


def _verify(params: SamplingParams, n: int, seed: int) -> list[list[int]]:
    """Verify ``DRAFTS`` for ``n`` identical requests in one batch."""
    rows = len(DRAFTS) + 1
    drafts = [DRAFTS] * n
    owner, outputs = expand_rows([params] * n, [[] for _ in range(n)], drafts)
    meta = build_sampling_metadata(
        [params] * len(owner), [[1]] * len(owner), outputs, [None] * len(owner), [], VOCAB, "cpu"
    )
    generator = torch.Generator().manual_seed(seed)
    out = Sampler(generator)(LOGITS.repeat(n, 1), meta)
    assert len(owner) == n * rows
    return accept(out.token_ids.tolist(), drafts)


def _exact(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Probability of every possible emitted sequence."""
    p = probs.tolist()
    exact: dict[tuple[int, ...], float] = {}
    prefix_prob = 1.0
    for a in range(len(DRAFTS) + 1):
        for x in range(VOCAB):
            if a < len(DRAFTS) and x == DRAFTS[a]:
                continue  # that is an acceptance, counted at a + 1
            exact[(*DRAFTS[:a], x)] = prefix_prob * p[a][x]
        if a < len(DRAFTS):
            prefix_prob *= p[a][DRAFTS[a]]
    assert sum(exact.values()) == pytest.approx(1.0)
    return exact


def _chi_square(counts: collections.Counter, exact: dict, n: int) -> tuple[float, int]:
    assert set(counts) <= {k for k, v in exact.items() if v > 0}, "an impossible output"
    stat, cells, rare_seen, rare_expected = 0.0, 0, 0, 0.0
    for key, prob in exact.items():
        expected = n * prob
        if expected < 5:
            rare_seen += counts.get(key, 0)
            rare_expected += expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        cells += 1
    if rare_expected:
        stat += (rare_seen - rare_expected) ** 2 / rare_expected
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize(
    "params, mask_top_k",
    [
        (SamplingParams(temperature=1.0), None),
        (SamplingParams(temperature=0.7, top_k=5), 5),
    ],
    ids=["t1", "t0.7-topk5"],
)
def test_emitted_sequences_follow_the_target_distribution(params, mask_top_k) -> None:
    n = 20_000
    logits = LOGITS / params.temperature
    if mask_top_k is not None:
        kth = logits.topk(mask_top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    exact = _exact(logits.softmax(dim=-1))
    counts = collections.Counter(tuple(t) for t in _verify(params, n, seed=1234))
    stat, df = _chi_square(counts, exact, n)
    assert df >= 15
    assert stat < chi_square_critical(df), (stat, df)
    # Every path ran many times: first-position rejection, acceptance of all three
    # drafts plus the bonus token.
    lengths = collections.Counter(len(t) for t in counts.elements())
    assert lengths[1] > 1000 and lengths[4] > 200


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    argmax = LOGITS.argmax(dim=-1).tolist()  # [3, 5, 3, 4]: all three drafts accepted
    assert _verify(SamplingParams(temperature=0.0), 3, seed=0) == [argmax] * 3
    assert accept([3, 9, 3, 4], [[3, 5, 3]]) == [[3, 9]]  # rejected at the second draft
    assert accept([7], [[]]) == [[7]]


def test_rows_see_the_drafts_as_outputs_only_where_sampling_depends_on_them() -> None:
    plain = SamplingParams(temperature=1.0)
    penalised = SamplingParams(temperature=1.0, frequency_penalty=0.5)
    owner, outputs = expand_rows([plain, penalised], [[1, 2], [1, 2]], [[7, 8], [7, 8]])
    assert owner == [0, 0, 0, 1, 1, 1]
    assert outputs[:3] == [[1, 2]] * 3
    assert outputs[3:] == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]


def test_seeded_generator_is_rewound_to_one_draw_per_emitted_token() -> None:
    """After verification a seeded request's generator is where it would be without
    speculation: one noise vector drawn per emitted token."""
    for num_accepted in range(len(DRAFTS) + 1):
        generator = torch.Generator().manual_seed(99)
        streams = SeededStreams([generator], [DRAFTS])
        for _ in range(len(DRAFTS) + 1):  # the sampler's draws for the four rows
            torch.rand(VOCAB, generator=generator)
        emitted = [[*DRAFTS[:num_accepted], 0]]
        streams.rewind(emitted, [DRAFTS], VOCAB)
        reference = torch.Generator().manual_seed(99)
        for _ in range(num_accepted + 1):
            torch.rand(VOCAB, generator=reference)
        assert torch.equal(
            torch.rand(VOCAB, generator=generator), torch.rand(VOCAB, generator=reference)
        )
