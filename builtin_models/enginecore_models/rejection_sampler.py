"""Verifying draft tokens so that speculation never changes what is sampled.

A request with drafts ``d1..dm`` is run over ``m + 1`` positions in one forward pass:
its last known token, then the drafts. Row ``j`` of its logits is the model's
distribution for the token after ``d1..dj``. Each row is sampled exactly as
non-speculative decoding would sample it, with sampling state (penalties, min_tokens,
logit bias) computed as if ``d1..dj`` had already been accepted, giving targets
``t0..tm``. Draft ``d(j+1)`` is accepted while it equals ``tj``; the output is the
accepted drafts and then the first target that disagreed (or the bonus ``tm``).

Why this is rejection sampling: a draft from a deterministic proposer (such as n-gram
lookup) is a point mass q at ``d``. Standard speculative rejection sampling accepts it
with probability ``min(1, p(d) / q(d)) = p(d)`` and otherwise draws from the residual
``max(p - q, 0)``, i.e. ``p`` without ``d``, renormalised. Sample-and-match accepts with
probability ``P(t == d) = p(d)``, and on rejection ``t`` is a draw from ``p`` given
``t != d``: the same residual. Every emitted token is therefore a draw from the target
distribution given the tokens before it, at every temperature. Greedy rows reduce to
"accept while the draft is the argmax".

Seeded requests draw one noise vector per position from their own generator. After
verification the generator is rewound to just after the accepted positions, so a
seeded request consumes exactly one draw per output token, as without speculation:
its output is token-for-token the same with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from enginecore.params import SamplingParams


def expand_rows(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[list[int]],
    drafts: Sequence[list[int]],
) -> tuple[list[int], list[list[int]]]:
    """Per logits row: the request it belongs to, and its output tokens so far.

    Row ``j`` of a request with drafts sees ``outputs + drafts[:j]``. The concatenated
    list is built only where the sampling state depends on it (penalties, min_tokens);
    otherwise the request's own list is shared.
    """
    owner: list[int] = []
    outputs: list[list[int]] = []
    for i, (p, out, d) in enumerate(zip(params, output_token_ids, drafts, strict=True)):
        owner.append(i)
        outputs.append(out)
        if not d:
            continue
        depends = p.needs_penalties or bool(p.min_tokens)
        for j in range(1, len(d) + 1):
            owner.append(i)
            outputs.append(out + d[:j] if depends else out)
    return owner, outputs


def accept(targets: Sequence[int], drafts: Sequence[list[int]]) -> list[list[int]]:
    """Per request: the accepted drafts then one sampled token (rows in request order)."""
    accepted: list[list[int]] = []
    row = 0
    for d in drafts:
        m = len(d)
        rows = targets[row : row + m + 1]
        row += m + 1
        a = 0
        while a < m and d[a] == rows[a]:
            a += 1
        accepted.append(list(rows[: a + 1]))
    return accepted


class SeededStreams:
    """Rewinds seeded requests' generators past the positions that were not accepted."""

    def __init__(
        self, generators: Sequence[torch.Generator | None], drafts: Sequence[list[int]]
    ) -> None:
        self._saved = {
            i: gen.get_state()
            for i, (gen, d) in enumerate(zip(generators, drafts, strict=True))
            if gen is not None and d
        }
        self._generators = generators

    def rewind(
        self, accepted: Sequence[list[int]], drafts: Sequence[list[int]], vocab: int
    ) -> None:
        for i, state in self._saved.items():
            num_used = len(accepted[i])
            if num_used == len(drafts[i]) + 1:
                continue  # every drawn row was used
            gen = self._generators[i]
            assert gen is not None
            gen.set_state(state)
            for _ in range(num_used):  # the sampler draws one vector per row
                torch.rand(vocab, generator=gen, device=gen.device)
