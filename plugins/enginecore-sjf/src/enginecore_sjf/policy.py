"""Shortest job first: admit the request with the least work left, preempt the most."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from enginecore.interfaces import SchedulingPolicy

if TYPE_CHECKING:
    from enginecore.request import Request

# Used when neither the request nor the config bounds the output length.
_UNBOUNDED_OUTPUT = 1 << 31


class ShortestJobFirstPolicy(SchedulingPolicy):
    """Order the waiting queue by remaining work, ties broken by arrival (``seq_no``).

    A job's remaining work is the prompt tokens not yet computed plus the output tokens
    it may still generate (``max_tokens`` minus those generated). Under memory pressure
    the running request with the most work left is preempted, so that short requests
    finish and free their blocks first.

    Pure SJF minimises mean latency but can starve long requests while short ones keep
    arriving; use it where requests are short-lived or bursts end.
    """

    name = "sjf"

    def remaining_tokens(self, request: Request) -> int:
        prompt_left = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        if request.max_tokens is not None:
            output_limit = request.max_tokens
        elif self.config.model.max_model_len is not None:
            output_limit = max(self.config.model.max_model_len - request.num_prompt_tokens, 0)
        else:
            output_limit = _UNBOUNDED_OUTPUT
        return prompt_left + max(output_limit - request.num_output_tokens, 0)

    def sort_key(self, request: Request) -> tuple[int, int]:
        return (self.remaining_tokens(request), request.seq_no)

    def pick_preemption_victim(self, running: Sequence[Request]) -> Request:
        # The longest remaining job; among equals the newest (largest seq_no).
        return max(running, key=self.sort_key)
