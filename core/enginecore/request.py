"""The scheduler-side request record, its status and why it finished."""

from __future__ import annotations

import enum
import time
from typing import Any

from enginecore.lora_request import LoRARequest
from enginecore.params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. An IntEnum so it is one byte on the wire; ``str()`` is the API name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """Order matters: every status after PREEMPTED is a finished one."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_IGNORED = 8
    FINISHED_ERROR = 9

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request as the scheduler sees it: tokens, progress and KV bookkeeping.

    ``seq_no`` is the engine's arrival counter; schedulers order by it (never by wall
    clock) so that scheduling is deterministic across identical engines.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "seq_no",
        "priority",
        "cache_salt",
        "client_index",
        "status",
        "num_computed_tokens",
        "output_token_ids",
        "all_token_ids",
        "max_tokens",
        "num_prompt_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_cached_tokens",
        "stop_reason",
        "block_hashes",
        "events",
        "extra",
        "kv_transfer_params",
        "spec_token_ids",
        "lora_request",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        seq_no: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        max_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.seq_no = seq_no
        self.priority = priority
        self.cache_salt = cache_salt
        self.client_index = client_index
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Resolved by the engine from sampling_params.max_tokens and max_model_len.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.num_output_placeholders = 0  # async scheduling: tokens scheduled, not yet sampled
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (-1: not yet)
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes | int] = []
        self.events: list[tuple[int, float]] = []
        self.extra: dict[str, Any] | None = sampling_params.extra
        self.kv_transfer_params: dict[str, Any] | None = None
        # Speculative decoding: the drafts proposed after the latest output we have seen.
        self.spec_token_ids: list[int] = []
        self.lora_request = lora_request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
            f"output={self.num_output_tokens})"
        )
