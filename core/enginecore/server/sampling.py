"""OpenAI request fields -> :class:`SamplingParams`, with the server's configured bounds."""

from __future__ import annotations

import json
from typing import Any

from enginecore.config import ServerConfig
from enginecore.errors import InvalidRequestError
from enginecore.params import MAX_LOGPROB_TOKEN_IDS, SamplingParams, StructuredOutputParams
from enginecore.server.client_quota import client_fields
from enginecore.server.errors import APIError
from enginecore.server.protocol import SamplingFields

#: vLLM's seed bounds: any 64-bit signed integer (``-1`` included).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def check_model(
    requested: str | None, served: str, path: str, aliases: tuple[str, ...] | list[str] = ()
) -> None:
    """A request may name the served model (by any of its served names, or its path), or
    leave ``model`` out; any other name is a 404, as OpenAI and vLLM answer it."""
    if requested is not None and requested not in (served, path, *aliases):
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served!r}",
            param="model",
        )


def _check_token_ids(ids: Any, vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            param=param,
        )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """Token id -> bias; every bad key is named at once (vLLM's out-of-vocabulary words)."""
    if not raw:
        return None
    not_ids = [key for key in raw if not key.strip().lstrip("-").isdigit()]
    if not_ids:
        raise APIError(
            400,
            f"logit_bias keys must be token ids, got {', '.join(map(repr, not_ids[:20]))}",
            param="logit_bias",
        )
    bias = {int(key): value for key, value in raw.items()}
    outside = [t for t in bias if not 0 <= t < vocab_size]
    if outside:
        raise APIError(
            400,
            f"token_id(s) {outside[:20]} in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            param="logit_bias",
        )
    out_of_range = [f"{key}: {value}" for key, value in raw.items() if not -100 <= value <= 100]
    if out_of_range:
        raise APIError(
            400,
            f"logit_bias values must be in [-100, 100], got {', '.join(out_of_range[:20])}",
            param="logit_bias",
        )
    return bias


def _structured_outputs_field(req: SamplingFields) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` object -> the engine's constraint fields."""
    spec = req.structured_outputs
    if spec is None:
        return None
    fields: dict[str, Any] = {}
    if spec.structural_tag is not None:
        tag = spec.structural_tag
        fields["structural_tag"] = tag if isinstance(tag, str) else json.dumps(tag)
    fields |= {
        key: value
        for key, value in (
            ("json", spec.json_),
            ("regex", spec.regex),
            ("choice", spec.choice),
            ("grammar", spec.grammar),
        )
        if value is not None
    }
    if spec.json_object:
        fields["json_object"] = True
    return fields


def structured_output(req: SamplingFields) -> StructuredOutputParams | None:
    """``response_format``, ``structured_outputs`` or one of the ``guided_*`` extras -> the
    engine's constraint."""
    given: dict[str, dict[str, Any]] = {}
    outputs = _structured_outputs_field(req)
    if outputs is not None:
        given["structured_outputs"] = outputs
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "structural_tag":
        if fmt.format is not None:
            tag: dict[str, Any] = {"type": "structural_tag", "format": fmt.format}
        elif fmt.structures is not None and fmt.triggers is not None:
            tag = {"structures": fmt.structures, "triggers": fmt.triggers}
        else:
            raise APIError(
                400,
                "response_format of type structural_tag needs structures and triggers (or "
                "xgrammar's format)",
                param="response_format",
            )
        given["response_format"] = {"structural_tag": json.dumps(tag)}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema",
                param="response_format",
            )
        given["response_format"] = {"json": fmt.json_schema.schema_}
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field)
        if value is not None:
            given[field] = {key: value}
    if not given:
        return None
    if len(given) > 1:
        raise APIError(
            400,
            f"give one structured-output constraint, got {', '.join(given)}",
            param=next(iter(given)),
        )
    ((param, fields),) = given.items()
    try:
        return StructuredOutputParams(**fields)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param) from None


def listed_logprob_ids(req: SamplingFields, logprobs: int | None, vocab_size: int) -> list[int]:
    """vLLM's ``logprob_token_ids``, checked in vLLM's words (an empty list: none)."""
    listed = req.logprob_token_ids or []
    if not listed:
        return []
    param = "logprob_token_ids"
    if req.use_beam_search:
        raise APIError(400, "`logprob_token_ids` is not supported with beam search.", param=param)
    if logprobs is None:
        raise APIError(400, "when using `logprob_token_ids`, `logprobs` must be set.", param=param)
    if len(listed) > MAX_LOGPROB_TOKEN_IDS:
        raise APIError(
            400,
            f"Requested logprob_token_ids of length {len(listed)}, which is greater than max "
            f"allowed: {MAX_LOGPROB_TOKEN_IDS}",
            param=param,
        )
    outside = [t for t in listed if not 0 <= t < vocab_size]
    if outside:
        raise APIError(
            400,
            f"token_id(s) {outside[:20]} in logprob_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            param=param,
        )
    return listed


def to_sampling_params(
    req: SamplingFields,
    limits: ServerConfig,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Validate bounds (400 on violation) and build the engine's sampling parameters;
    ``defaults`` (the checkpoint's generation_config) fill the fields the request left out."""
    defaults = defaults or {}
    if req.n > limits.max_n:
        raise APIError(400, f"n must be at most {limits.max_n}, got {req.n}", param="n")
    if not req.use_beam_search:
        for name, unset in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(req, name) != unset:
                raise APIError(400, f"{name} applies only with use_beam_search: true", param=name)
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    limit = limits.max_tokens_limit
    if limit is not None:
        if max_tokens is not None and max_tokens > limit:
            raise APIError(
                400, f"max_tokens must be at most {limit}, got {max_tokens}", param="max_tokens"
            )
        max_tokens = limit if max_tokens is None else max_tokens
    logprobs = resolve_logprobs(logprobs, limits, vocab_size, "logprobs")
    optional: dict[str, Any] = {}
    listed = listed_logprob_ids(req, logprobs, vocab_size)
    if listed:  # the listed ids take the place of the top ones
        optional["logprob_token_ids"] = listed
        logprobs = None
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise APIError(400, f"seed must be a 64-bit signed integer, got {req.seed}", param="seed")
    if req.stop_token_ids:
        _check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    extra: dict[str, Any] = dict(req.metadata or {})
    if req.user is not None:
        extra["user"] = req.user
    extra.update(client_fields())  # the client's key and rank (not the body's)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            optional[name] = value
    return SamplingParams(
        n=req.n,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        extra=extra or None,
        kv_transfer_params=req.kv_transfer_params,
        structured_output=structured_output(req),
        **optional,
    )


def resolve_logprobs(
    wanted: int | None, limits: ServerConfig, vocab_size: int, param: str
) -> int | None:
    """A request's ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` count, as vLLM reads
    it: ``-1`` asks for the whole vocabulary; more than ``max_logprobs`` (``-1``: the
    vocabulary) is a 400 in vLLM's words."""
    if wanted is None:
        return None
    if wanted < -1:
        raise APIError(
            400,
            f"{param} must be a non-negative integer, or -1 for the whole vocabulary; got {wanted}",
            param=param,
        )
    allowed = vocab_size if limits.max_logprobs == -1 else limits.max_logprobs
    count = vocab_size if wanted == -1 else wanted
    if count > allowed:
        kind = "prompt" if param == "prompt_logprobs" else "sample"
        raise APIError(
            400,
            f"{param} must be at most {allowed}: Requested {kind} logprobs of {count}, which "
            f"is greater than max allowed: {allowed} (the server's max_logprobs; -1 admits "
            "the whole vocabulary)",
            param=param,
        )
    return count


def resolve_logprob_fields(req: SamplingFields, limits: ServerConfig, vocab_size: int) -> None:
    """Each logprob count a request names (``logprobs``, ``top_logprobs``,
    ``prompt_logprobs``) checked and resolved in place (``-1``: the vocabulary's size), so
    that every later use of the request reads a plain count."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(req, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(req, name, resolve_logprobs(value, limits, vocab_size, name))


def check_max_tokens(
    max_tokens: int | None, prompt_len: int, max_model_len: int, param: str = "max_tokens"
) -> None:
    """vLLM's rule: asking for more tokens than the context leaves after the prompt is a 400
    (never a silent cut)."""
    if max_tokens is not None and max_tokens > max_model_len - prompt_len:
        raise APIError(
            400,
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len}).",
            param=param,
        )


def truncate_prompt(
    token_ids: list[int], keep: int | None, max_model_len: int, side: str | None = None
) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: ``keep`` of the prompt's tokens (-1: as many as
    ``max_model_len`` holds), the last ones (``side`` left, the default) or the first."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({max_model_len})",
            param="truncate_prompt_tokens",
        )
    if not keep:
        return []
    return token_ids[:keep] if side == "right" else token_ids[-keep:]
