"""Wire structs between the frontend and the engine core.

All structs are ``msgspec.Struct(array_like=True, omit_defaults=True, gc=False)``: they
encode as positional msgpack arrays, so **field order is the wire ABI**. Add new fields
only at the end, with a default; never reorder or remove one. The frontend and the
engine core always run the same enginecore version, but plugins may read these structs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Container
from typing import Any

import msgspec

from enginecore.lora_request import LoRARequest
from enginecore.params import SamplingParams
from enginecore.request import FinishReason


class EngineCoreRequestType(bytes, enum.Enum):
    """One-byte tag of every message sent to the engine core."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    client_index: int = 0
    data_parallel_rank: int | None = None
    max_tokens: int | None = None  # resolved by the frontend against max_model_len
    lora_request: LoRARequest | None = None  # served with this LoRA adapter


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Per prompt token after the first: ``[prompt token, top-1..top-N]`` ids and
    logprobs, and the prompt token's rank in the vocabulary."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's new tokens in one step."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: [sampled, top-1..top-N] ids and logprobs, and the sampled token's rank.
    new_logprob_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_sampled_ranks: list[int] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[tuple[int, float]] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # With the first token of a request that asked for prompt logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling request's vector, with its (only, finishing) output.
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    failure_message: str | None = None  # set: the call failed
    result: Any = None
    failure_rank: int | None = None  # set: a worker RPC raised on this rank (RankError)
    failure_method: str | None = None
    failure_engine_dead: bool = False  # set: the engine or one of its workers died in it


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Made by the scheduler each step, in the engine core; shipped with the outputs."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preemptions: int = 0
    step_counter: int = 0
    num_scheduled_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # KV connector: prompt tokens loaded instead of computed (this step), and requests
    # parked until their external KV arrives.
    num_kv_loaded_tokens: int = 0
    num_waiting_for_remote_kvs: int = 0
    # Prompt tokens computed by the model since the last stats (cache and KV connector
    # hits excluded): what prefix caching and connectors save.
    num_prompt_tokens_computed: int = 0
    # Speculative decoding: accepted draft tokens by draft position (0 = the first draft
    # token) since the last stats; a draft is accepted only after every earlier one.
    spec_num_accepted_tokens_per_pos: list[int] = []
    # LoRA: requests running / waiting per adapter name (vLLM's lora_requests_info).
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    # KV connector: malformed or refused messages from peers since the last stats.
    num_kv_rejected_messages: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's batch for one client: the boundary is crossed once per step."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    engine_dead: str | None = None  # set on the ENGINE_CORE_DEAD sentinel: what died and why
    # A plain decode step's outputs as two columns, beside ``outputs``: request
    # ``plain_req_ids[i]`` gained the one token ``plain_token_ids[i]`` and nothing else
    # (not its first token; no finish, logprobs, events or other payload). A scheduler
    # fills them only where the engine asks for it (``plain_output_columns``).
    plain_req_ids: list[str] = []
    plain_token_ids: list[int] = []

    def stamp(self) -> EngineCoreOutputs:
        self.timestamp = time.monotonic()
        return self

    def plain_outputs(self) -> list[EngineCoreOutput]:
        """The plain rows as :class:`EngineCoreOutput` objects (the general form)."""
        return [
            EngineCoreOutput(request_id=request_id, new_token_ids=[token_id])
            for request_id, token_id in zip(self.plain_req_ids, self.plain_token_ids, strict=True)
        ]

    def all_outputs(self) -> list[EngineCoreOutput]:
        """Every request's output of the step: ``outputs`` and the plain rows unfolded."""
        return self.outputs + self.plain_outputs() if self.plain_req_ids else self.outputs

    def unfold_plain(self, request_ids: Container[str]) -> None:
        """Move the plain rows of ``request_ids`` into ``outputs`` (to be amended there)."""
        if not self.plain_req_ids:
            return
        keep_ids: list[str] = []
        keep_tokens: list[int] = []
        for request_id, token_id in zip(self.plain_req_ids, self.plain_token_ids, strict=True):
            if request_id in request_ids:
                self.outputs.append(EngineCoreOutput(request_id, [token_id]))
            else:
                keep_ids.append(request_id)
                keep_tokens.append(token_id)
        self.plain_req_ids = keep_ids
        self.plain_token_ids = keep_tokens

    def extend(self, other: EngineCoreOutputs) -> None:
        """Take ``other``'s outputs and plain rows in after this one's."""
        self.outputs.extend(other.outputs)
        if other.plain_req_ids:
            self.plain_req_ids = self.plain_req_ids + other.plain_req_ids
            self.plain_token_ids = self.plain_token_ids + other.plain_token_ids


class EngineCoreReadyResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The start-up handshake: facts the frontend only learns once the engine is built."""

    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    components: dict[str, str] = {}
    pid: int = 0
