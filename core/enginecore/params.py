"""Request parameters users pass in: :class:`SamplingParams` (shaped like vLLM's)."""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.errors import InvalidRequestError
from enginecore.pooling import PoolingParams

#: The most token ids one request's ``logprob_token_ids`` may list (vLLM's bound).
MAX_LOGPROB_TOKEN_IDS = 128


class StructuredOutputParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice, a grammar
    or structural tags."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    """vLLM's structural tags, as JSON text: ``{"structures": [{"begin", "schema", "end"},
    ...], "triggers": [...]}``. Text outside the tags is free; after a trigger the output
    is one of the tags, whose content follows its JSON schema."""
    reasoning_end: list[list[int]] | None = None
    """Token-id sequences that end a reasoning model's thinking: the constraint applies
    only to the tokens after the first time the output contains one of them (set by the
    server's reasoning parser; None: from the first token)."""

    def __post_init__(self) -> None:
        given = [
            n
            for n in ("json", "regex", "choice", "grammar", "structural_tag")
            if getattr(self, n) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_output needs exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {given or 'none'}"
            )


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True, array_like=True):
    """How to sample one request. Invalid values raise :class:`InvalidRequestError` at once.

    Field order is wire ABI (the struct travels in ``EngineCoreRequest``): append new fields.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: sampled token only)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutputParams | None = None
    extra: dict[str, Any] | None = None  # user metadata, passed through to stat loggers
    # Set by the frontend: EOS and every stop token id, so the sampler can hold them
    # back below min_tokens. Users set stop_token_ids instead.
    all_stop_token_ids: list[int] | None = None
    # Top-N logprobs of each prompt token after the first (0: the prompt token only).
    # Requests that ask for them bypass prefix-cache hits (cached tokens have no logits).
    prompt_logprobs: int | None = None
    # KV connector handle for this request (disaggregated prefill/decode): what the
    # prefill instance returned in its output's ``kv_transfer_params``.
    kv_transfer_params: dict[str, Any] | None = None
    # Set: a pooling request (embeddings), served by the ``pooling`` model runner. Its
    # one "token" is a placeholder; the pooled vector comes back instead.
    pooling: PoolingParams | None = None
    # vLLM's ``logprob_token_ids``: each sampled position reports the logprobs of exactly
    # these token ids (besides the sampled token's) instead of the top ``logprobs``. At
    # most MAX_LOGPROB_TOKEN_IDS; ``logprobs``, left out, becomes their count.
    logprob_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        problems: list[str] = []
        self._check_logprob_token_ids(problems)
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            problems.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            problems.append(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and self.logprobs < 0:
            problems.append(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            problems.append(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            problems.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            problems.append(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.stop is not None and any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise InvalidRequestError("invalid SamplingParams: " + "; ".join(problems))

    def _check_logprob_token_ids(self, problems: list[str]) -> None:
        listed = self.logprob_token_ids
        if not listed:
            self.logprob_token_ids = None  # vLLM: an empty list keeps the natural top-k
            return
        if len(listed) > MAX_LOGPROB_TOKEN_IDS:
            problems.append(
                f"Requested logprob_token_ids of length {len(listed)}, which is greater "
                f"than max allowed: {MAX_LOGPROB_TOKEN_IDS}"
            )
        negative = [t for t in listed if t < 0]
        if negative:
            problems.append(
                f"token_id(s) {negative[:20]} in logprob_token_ids contain out-of-vocab token ids"
            )
        if self.logprobs is None:
            self.logprobs = len(listed)
        elif self.logprobs != len(listed):
            problems.append(
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={self.logprobs}, "
                f"len(logprob_token_ids)={len(listed)}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)
