"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``), gathered over prefill chunks.

The logits at prompt position ``i`` score prompt token ``i + 1``; the first prompt token
has no logprob. A chunk covering positions ``a..b-1`` therefore yields the entries for
tokens ``a+1..min(b, P-1)``. Entries accumulate on the request while its prefill is
chunked and are sent once, with the request's first sampled token. Values come from the
raw model logits (before penalties, bias or temperature), like sampled-token logprobs.

A request asking for prompt logprobs never takes prefix-cache hits (the KV cache manager
skips the lookup), since cached positions would have no logits; it still fills the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enginecore.runner_output import LogprobsLists


@dataclass
class PromptLogprobsAccumulator:
    """Rows ``[prompt token, top-1..top-N]`` for prompt tokens 1..P-1, in order."""

    num_top: int
    num_prompt_tokens: int
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def wants(self, start: int, end: int) -> tuple[int, int] | None:
        """Chunk rows (relative to ``start``) whose next token is a prompt token not yet
        scored, or None. ``start..end-1`` are the chunk's positions."""
        first = max(start, len(self.ranks))  # position whose logits score token first+1
        last = min(end, self.num_prompt_tokens - 1)  # exclusive
        if first >= last:
            return None
        return first - start, last - start

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``logits`` [n, vocab] (raw) at the positions before ``targets`` [n]."""
        logprobs = logits.float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        if self.num_top > 0:
            top_vals, top_ids = logprobs.topk(min(self.num_top, logprobs.shape[-1]), dim=-1)
            ids = torch.cat([targets.unsqueeze(1), top_ids], dim=1)
            vals = torch.cat([chosen, top_vals], dim=1)
        else:
            ids, vals = targets.unsqueeze(1), chosen
        self.token_ids.extend(ids.tolist())
        self.logprobs.extend(vals.tolist())
        self.ranks.extend(ranks.tolist())

    @property
    def complete(self) -> bool:
        return len(self.ranks) >= self.num_prompt_tokens - 1

    def result(self) -> LogprobsLists:
        return LogprobsLists(
            logprob_token_ids=self.token_ids, logprobs=self.logprobs, sampled_token_ranks=self.ranks
        )
