"""What a model runner returns each step."""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.lora_request import LoRALoadReport


class LogprobsLists(msgspec.Struct, kw_only=True):
    """Per request row: ``[sampled, top-1, ..., top-N]`` token ids and their logprobs."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]
    # Speculative decoding: the rows are per generated token, and request i owns rows
    # cu_num_generated_tokens[i]:cu_num_generated_tokens[i + 1]. None: one row per request.
    cu_num_generated_tokens: list[int] | None = None


class KVConnectorOutput(msgspec.Struct, kw_only=True):
    finished_sending: set[str] = set()
    finished_recving: set[str] = set()
    failed_recving: set[str] = set()
    invalid_block_ids: set[int] = set()
    # Requests whose load or save failed: id -> error text (the request fails).
    failures: dict[str, str] = {}
    # Malformed or refused messages from peers since the last step (a metric).
    num_rejected_messages: int = 0


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    req_ids: list[str] = []
    req_id_to_index: dict[str, int] = {}
    # Per request: [] while a prefill chunk is partial, one token for a decode step,
    # 1 + accepted drafts with speculative decoding.
    sampled_token_ids: list[list[int]] = []
    logprobs: LogprobsLists | None = None
    kv_connector_output: KVConnectorOutput | None = None
    extra: dict[str, Any] | None = None
    # Requests that asked for prompt logprobs, when their prefill completes: one row per
    # prompt token after the first, ``[prompt token, top-1..top-N]`` and its rank.
    prompt_logprobs: dict[str, LogprobsLists] | None = None
    # Speculative decoding, per request row: drafts proposed for the next step (from the
    # tokens above), and how many drafts this step verified (accepted = len(sampled) - 1).
    draft_token_ids: list[list[int]] | None = None
    num_draft_tokens: list[int] | None = None
    # Pooling runner: each pooling request whose prompt completed this step -> its vector.
    pooler_output: dict[str, list[float]] | None = None
    # LoRA: adapters read, failed or evicted since the last step (None: nothing new).
    lora_report: LoRALoadReport | None = None
    # Requests that cannot go on (a proposer's malformed drafts): id -> the error, named.
    # The engine finishes each with it after this step's tokens; the others run on.
    request_errors: dict[str, str] | None = None
