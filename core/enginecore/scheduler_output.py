"""What the scheduler hands the workers each step: a delta, not the whole state.

New requests carry everything a worker needs; requests the workers already hold carry
only new block ids and counters. Workers keep each request's tokens themselves (they
sampled them), which is what lets the next step be scheduled before tokens are known.
"""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.lora_request import LoRARequest
from enginecore.params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the workers have not seen, or must rebuild (resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens generated before a preemption (empty for a fresh request): the worker
    # recomputes their KV and needs them for penalties and seeded sampling.
    output_token_ids: list[int] = []
    # Models with several KV cache groups (sliding-window and full-attention layers):
    # every group's block ids, in group order; ``block_ids`` is then the first group's.
    # None with a single group. A released (out-of-window) block reads as block 0.
    group_block_ids: list[list[int]] | None = None
    # The LoRA adapter the request is served with (None: the base model).
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, kw_only=True):
    """Requests the workers already hold, column by column."""

    req_ids: list[str] = []
    new_block_ids: list[list[int] | None] = []  # appended to the request's block table
    # Several KV cache groups: each request's new ids per group (None: none this step);
    # ``new_block_ids`` then holds the first group's. Empty with a single group.
    new_group_block_ids: list[list[list[int]] | None] = []
    num_computed_tokens: list[int] = []
    # Filled only when workers do not sample themselves (pipeline parallelism).
    new_token_ids: list[list[int]] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, kw_only=True):
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # Draft tokens to verify this step after each decode's one token (speculative
    # decoding; counted in num_scheduled_tokens). -1 entries are placeholders: the
    # scheduler has not seen the drafts yet (async scheduling) and the runner verifies
    # up to that many drafts of its own.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Finished or aborted since the last step: workers drop their state.
    finished_req_ids: set[str] = set()
    # Preempted since the last step: workers drop their state; they come back as new.
    preempted_req_ids: set[str] = set()
    # Requests under a grammar this step (the engine builds their bitmask).
    structured_output_request_ids: list[str] = []
    kv_connector_metadata: Any = None
    step_id: int = 0
    # LoRA adapters waiting requests name that the workers have not reported read: each
    # worker starts reading those it is not reading yet, off the step (it reports them in
    # ``ModelRunnerOutput.lora_report``).
    lora_loads: list[LoRARequest] = []
    # LoRA adapters unloaded that no request names any more (``lora_int_id``): each
    # worker frees their device slots and host copies (reported as ``evicted``).
    lora_removals: list[int] = []


class GrammarOutput(msgspec.Struct, kw_only=True):
    """The grammar bitmask for one step, built while the forward pass runs."""

    structured_output_request_ids: list[str]
    # numpy int32 [rows, ceil(vocab / 32)], bit j of word w allows token 32 * w + j. Rows
    # follow structured_output_request_ids: one per request, then one per draft token it
    # has in scheduled_spec_decode_tokens (the mask after accepting the drafts before it).
    grammar_bitmask: Any
