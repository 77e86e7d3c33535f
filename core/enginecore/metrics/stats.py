"""What the frontend knows about one finished request (for stat loggers and observers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class FinishedRequestStats:
    """One finished request, as :class:`enginecore.interfaces.IterationStats` carries it.

    The same object reaches every selected stat logger (through
    ``IterationStats.finished_requests``) and every ``request_finished(request_stats)``
    hook implementation. Times are in seconds; a time that was never measured (an
    aborted request that never ran) is ``0.0``.
    """

    request_id: str
    finish_reason: str
    """``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (a ``FinishReason`` is converted)."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    e2e_latency: float = 0.0
    """Arrival in the frontend to the last token."""
    queued_time: float = 0.0
    """Time spent waiting in the scheduler before the first scheduling."""
    prefill_time: float = 0.0
    """First scheduling to the first token."""
    inference_time: float = 0.0
    """First scheduling to the last token (prefill and decode, preemptions included)."""
    decode_time: float = 0.0
    """First token to the last token."""
    ttft: float = 0.0
    """Time to first token: arrival in the frontend to the first token."""
    mean_tpot: float = 0.0
    """Mean time per output token after the first (0.0 with fewer than two tokens)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    num_preemptions: int = 0
    """Times the scheduler preempted the request."""
    max_tokens_param: int | None = None
    """The request's ``max_tokens`` (``None``: up to the model's context length)."""
    extra: dict[str, Any] | None = None
    """The request's user metadata (``SamplingParams.extra``), passed through untouched."""

    def __post_init__(self) -> None:
        # FinishReason is an IntEnum whose str() is its API name; keep the record plain
        # data so that every logger (JSON, Prometheus labels) sees "stop", never 0.
        self.finish_reason = str(self.finish_reason)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (``extra`` is copied shallowly)."""
        data = dataclasses.asdict(self)
        if self.extra is not None:
            data["extra"] = dict(self.extra)
        return data
