"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``), gathered over prefill chunks.

The logits at prompt position ``i`` score prompt token ``i + 1``; the first prompt token
has no logprob. A chunk covering positions ``a..b-1`` therefore yields the entries for
tokens ``a+1..min(b, P-1)``. Entries accumulate on the request while its prefill is
chunked and are sent once, with the request's first sampled token. Values come from the
raw model logits (before penalties, bias or temperature), like sampled-token logprobs.

Each chunk's scores stay on the device: a chunk that samples nothing reads nothing back,
and the step that samples the first token carries them all in its one device-to-host
copy (:func:`device_rows` packs them, :func:`split_rows` unpacks the copy).

A request asking for prompt logprobs never takes prefix-cache hits (the KV cache manager
skips the lookup), since cached positions would have no logits; it still fills the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from enginecore.runner_output import LogprobsLists


@dataclass
class PromptLogprobsAccumulator:
    """Rows ``[prompt token, top-1..top-N]`` for prompt tokens 1..P-1, in order."""

    num_top: int
    num_prompt_tokens: int
    num_scored: int = 0  # prompt tokens scored so far (rows held in ``chunks``)
    width: int = 1  # columns per row: the prompt token, then the top-N
    # Per chunk, on the device: ids [n, width], logprobs [n, width], ranks [n].
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def wants(self, start: int, end: int) -> tuple[int, int] | None:
        """Chunk rows (relative to ``start``) whose next token is a prompt token not yet
        scored, or None. ``start..end-1`` are the chunk's positions."""
        first = max(start, self.num_scored)  # position whose logits score token first+1
        last = min(end, self.num_prompt_tokens - 1)  # exclusive
        if first >= last:
            return None
        return first - start, last - start

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``logits`` [n, vocab] (raw) at the positions before ``targets`` [n]; nothing
        is read back here."""
        logprobs = logits.float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        if self.num_top > 0:
            top_vals, top_ids = logprobs.topk(min(self.num_top, logprobs.shape[-1]), dim=-1)
            ids = torch.cat([targets.unsqueeze(1), top_ids], dim=1)
            vals = torch.cat([chosen, top_vals], dim=1)
        else:
            # A copy: ``targets`` is a view of a staging buffer the next step refills.
            ids, vals = targets.unsqueeze(1).clone(), chosen
        self.width = ids.shape[1]
        self.chunks.append((ids, vals, ranks))
        self.num_scored += logits.shape[0]

    @property
    def complete(self) -> bool:
        return self.num_scored >= self.num_prompt_tokens - 1


def device_rows(
    accumulators: Sequence[PromptLogprobsAccumulator],
) -> list[torch.Tensor]:
    """Every chunk of ``accumulators`` packed flat: ids, logprobs and ranks (three
    tensors for the step's copy; none when nothing was scored)."""
    chunks = [c for acc in accumulators for c in acc.chunks]
    if not chunks:
        return []
    return [
        torch.cat([ids.reshape(-1) for ids, _, _ in chunks]),
        torch.cat([vals.reshape(-1) for _, vals, _ in chunks]),
        torch.cat([ranks for _, _, ranks in chunks]),
    ]


def split_rows(
    accumulators: Sequence[PromptLogprobsAccumulator], host: Sequence[np.ndarray]
) -> list[LogprobsLists]:
    """Each accumulator's result from the copied arrays of :func:`device_rows`."""
    if host:
        ids, vals, ranks = host
    else:  # nothing scored (one-token prompts)
        ids, ranks, vals = np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)
    results = []
    cell = row = 0
    for acc in accumulators:
        n = acc.num_scored
        cells = n * acc.width
        results.append(
            LogprobsLists(
                logprob_token_ids=ids[cell : cell + cells].reshape(n, acc.width).tolist(),
                logprobs=vals[cell : cell + cells].reshape(n, acc.width).astype(float).tolist(),
                sampled_token_ranks=ranks[row : row + n].tolist(),
            )
        )
        cell += cells
        row += n
    return results
