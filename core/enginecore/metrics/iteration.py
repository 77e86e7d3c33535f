"""Builds the frontend's per-step statistics from request state as outputs are folded in.

The frontend (AsyncLLM) owns the clocks users care about — arrival, first token, each
later token — so :class:`IterationStats` and :class:`FinishedRequestStats` are made here,
from :class:`~enginecore.engine.output.RequestState`, never in the engine core.
"""

from __future__ import annotations

from typing import Any

from enginecore.interfaces import IterationStats
from enginecore.metrics.stats import FinishedRequestStats


class TokenTimes:
    """A request's token clock before this step's output was applied."""

    __slots__ = ("first_token", "last_token", "num_tokens")

    def __init__(self, state: Any) -> None:
        self.first_token = state.times.first_token
        self.last_token = state.times.last_token
        self.num_tokens = len(state.token_ids)


class IterationStatsBuilder:
    """One step: call :meth:`observe` per request output, :meth:`finish` per finished one."""

    def __init__(self, timestamp: float) -> None:
        self.stats = IterationStats(timestamp=timestamp)
        self._parents_done: set[str] = set()

    def observe(self, state: Any, before: TokenTimes, now: float) -> None:
        new_tokens = len(state.token_ids) - before.num_tokens
        if new_tokens <= 0:
            return
        stats = self.stats
        stats.num_generation_tokens += new_tokens
        if before.first_token is None:
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.time_to_first_tokens.append(now - state.times.arrival)
        else:
            stats.inter_token_latencies.append(now - before.last_token)

    def next_tokens(self, gaps: list[float]) -> None:
        """:meth:`observe` for one more token of each of several requests that already
        had their first, ``gaps`` seconds after the one before (one gap per request)."""
        stats = self.stats
        stats.num_generation_tokens += len(gaps)
        stats.inter_token_latencies.extend(gaps)

    def finish(self, stats: FinishedRequestStats, state: Any = None) -> None:
        self.stats.finished_requests.append(stats)
        if state is not None:
            self.user_request_finished(state)

    def user_request_finished(self, state: Any) -> None:
        """Records ``n`` and the longest sample once the request's last sample finished."""
        parent = state.parent
        if parent is None:
            self.stats.n_params.append(1)
            self.stats.max_num_generation_tokens.append(len(state.token_ids))
            return
        children = [child for child in parent.children if child is not None]
        if parent.request_id in self._parents_done or any(
            child.finish_reason is None for child in children
        ):
            return  # a sample is still running (or the request was recorded this step)
        self._parents_done.add(parent.request_id)
        self.stats.n_params.append(len(parent.children))
        self.stats.max_num_generation_tokens.append(
            max((len(child.token_ids) for child in children), default=0)
        )


def finished_request_stats(state: Any, now: float, reason: Any = None) -> FinishedRequestStats:
    """The record of one finished (or aborted) request, from its frontend state."""
    times = state.times
    first, last = times.first_token, times.last_token
    finished = times.finished if times.finished is not None else now
    num_tokens = len(state.token_ids)
    prefill = inference = 0.0
    if first is not None and times.scheduled is not None:
        # Both clocks are time.monotonic() on the same host (the engine core is local).
        prefill = max(first - times.scheduled, 0.0)
        inference = max(last - times.scheduled, 0.0)
    queued = 0.0
    if times.queued is not None and times.scheduled is not None:
        queued = max(times.scheduled - times.queued, 0.0)
    return FinishedRequestStats(
        request_id=state.request_id,
        finish_reason=reason if reason is not None else state.finish_reason,
        num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=num_tokens,
        e2e_latency=max(finished - times.arrival, 0.0),
        queued_time=queued,
        prefill_time=prefill,
        inference_time=inference,
        decode_time=max(last - first, 0.0) if first is not None else 0.0,
        ttft=(first - times.arrival) if first is not None else 0.0,
        mean_tpot=(last - first) / (num_tokens - 1) if num_tokens > 1 and first else 0.0,
        num_cached_tokens=state.num_cached_tokens,
        num_preemptions=state.num_preemptions,
        max_tokens_param=state.params.max_tokens,
        extra=state.params.extra,
    )
