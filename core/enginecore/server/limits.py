"""Limits on what one request may hold, checked before anything reaches the engine.

A request body is parsed JSON of any shape; the fields the OpenAI schema leaves free-form
(``metadata``, ``kv_transfer_params``, JSON schemas, ``logit_bias``, ``tools``, ...) travel
to the engine process and its workers, where a structure nested hundreds of levels deep
breaks serialization for the whole batch. Every limit here answers 400 naming the
``server`` config key that sets it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from enginecore.config import ServerConfig
from enginecore.server.errors import APIError

if TYPE_CHECKING:
    from enginecore.engine.async_llm import AsyncLLM

#: Top-level fields whose content the schema does not bound (sizes checked one by one).
FREE_FORM_FIELDS = (
    "metadata",
    "kv_transfer_params",
    "guided_json",
    "response_format",
    "logit_bias",
    "tools",
    "chat_template_kwargs",
)


#: Fields that carry the prompt: bounded by the prompt token limits, not max_field_bytes.
PROMPT_FIELDS = frozenset({"prompt", "messages", "input", "instructions"})

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64_problem(value: int) -> str:
    """An integer beyond 64 bits, named with the bound it breaks as pydantic names it (the
    ``less_than_equal`` / ``greater_than_equal`` vLLM's clients read)."""
    if value > INT64_MAX:
        bound = f"Input should be less than or equal to {INT64_MAX} (less_than_equal)"
    else:
        bound = f"Input should be greater than or equal to {INT64_MIN} (greater_than_equal)"
    return f"the integer {value} is outside the signed 64-bit range: {bound}"


def _bad_scalar(value: Any) -> str | None:
    """Why a JSON scalar cannot travel to the engine, or None when it can."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return _int64_problem(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            return f"{value} is not a finite number (NaN and Infinity are not JSON numbers)"
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "a string holds a lone surrogate escape (it is not valid UTF-8)"
    return None


def scan_json(value: Any, stop_after: int) -> tuple[int, str | None]:
    """``(depth, problem)``: the nesting depth of objects and arrays (a scalar is 0;
    counting stops past ``stop_after``) and the first value that cannot travel to the
    engine (:func:`_bad_scalar`), or None. Iterative, so a body deeper than Python's
    recursion limit is fine."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
            for key in node:
                problem = _bad_scalar(key)
                if problem:
                    return deepest, problem
        elif isinstance(node, list):
            if node and all(type(x) is int for x in node):  # token ids: checked at once
                if min(node) < INT64_MIN or max(node) > INT64_MAX:
                    return deepest, _int64_problem(
                        min(node) if min(node) < INT64_MIN else max(node)
                    )
                deepest = max(deepest, depth + 1)
                continue
            if node and all(type(x) is str for x in node):  # prompts, stop strings: at once
                # Joining cannot pair two lone surrogates: a Python str keeps them apart.
                problem = _bad_scalar("".join(node))
                if problem:
                    return deepest, problem
                deepest = max(deepest, depth + 1)
                continue
            children = node
        else:
            problem = _bad_scalar(node)
            if problem:
                return deepest, problem
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > stop_after:
                return deepest, None
        stack.extend((child, depth) for child in children)
    return deepest, None


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def check_limits(body: Any, limits: ServerConfig) -> None:
    """Raise a 400 :class:`APIError` if the parsed body exceeds a configured limit."""
    fields = body.items() if isinstance(body, dict) else [(None, body)]
    for name, value in fields:
        depth, problem = scan_json(value, limits.max_json_depth)
        problem = problem or (_bad_scalar(name) if name is not None else None)
        where = f"{name}: " if name is not None else ""
        if depth + (name is not None) > limits.max_json_depth:
            raise APIError(
                400,
                f"{where}objects and arrays nest more than {limits.max_json_depth} levels "
                f"deep (server limit max_json_depth={limits.max_json_depth})",
                param=name,
            )
        if problem:
            raise APIError(400, f"{where}{problem}", param=name)
    if not isinstance(body, dict):
        return
    # Every other free-form string (``user``, ids, ...) counts too: the server may keep it
    # (the Responses store echoes ``user``).
    strings = [k for k, v in body.items() if isinstance(v, str) and k not in PROMPT_FIELDS]
    for name in (*FREE_FORM_FIELDS, *strings):
        value = body.get(name)
        if value is None:
            continue
        size = _json_size(value)
        if size > limits.max_field_bytes:
            raise APIError(
                400,
                f"{name} is {size} bytes of JSON; the limit is max_field_bytes="
                f"{limits.max_field_bytes}",
                param=name,
            )
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias_entries:
        raise APIError(
            400,
            f"logit_bias names {len(bias)} tokens; the limit is max_logit_bias_entries="
            f"{limits.max_logit_bias_entries}",
            param="logit_bias",
        )
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise APIError(
            400,
            f"{len(tools)} tools given; the limit is max_tools={limits.max_tools}",
            param="tools",
        )
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    if many and isinstance(prompt, list) and len(prompt) > limits.max_prompts_per_request:
        raise APIError(
            400,
            f"{len(prompt)} prompts in one request; the limit is max_prompts_per_request="
            f"{limits.max_prompts_per_request}",
            param="prompt",
        )


async def check_body_limits(request: Request) -> None:
    """FastAPI dependency for every JSON route: FastAPI has already parsed the body (and
    cached it on the request), so this walks it without parsing it again."""
    if request.method != "POST":
        return
    try:
        body = await request.json()
    except Exception:
        return  # not JSON: the route's own validation answers 400
    check_limits(body, request.app.state.ctx.limits)


def check_prompt_tokens(counts: Sequence[int], limits: ServerConfig) -> None:
    total = sum(counts)
    if total > limits.max_prompt_tokens_per_request:
        raise APIError(
            400,
            f"the request's prompts hold {total} tokens; the limit is "
            f"max_prompt_tokens_per_request={limits.max_prompt_tokens_per_request}",
            param="prompt",
        )


async def tokenize_prompts(
    tokenizer: Any, prompts: Sequence[str | list[int]], limits: ServerConfig
) -> list[dict[str, Any]]:
    """Tokenize text prompts in a worker thread (a multi-megabyte prompt must not hold the
    event loop) and bound the request's total; returns engine prompts that carry both
    the text and its token ids."""
    check_prompt_tokens([len(p) for p in prompts if isinstance(p, list)], limits)

    def encode_all() -> list[dict[str, Any]]:
        result = []
        for prompt in prompts:
            if isinstance(prompt, str):
                result.append({"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)})
            else:
                result.append({"prompt_token_ids": list(prompt)})
        return result

    encoded = await asyncio.to_thread(encode_all)
    check_prompt_tokens([len(p["prompt_token_ids"]) for p in encoded], limits)
    return encoded


async def check_capacity(request: Request) -> None:
    """FastAPI dependency for the generation routes: 503 (with Retry-After) instead of
    queueing without bound when the engine is not keeping up."""
    ctx = request.app.state.ctx
    limit = ctx.limits.max_pending_requests
    engine: AsyncLLM = ctx.engine
    pending = len(engine.collectors)
    sends = engine.engine_client.pending_sends()
    if pending >= limit or sends >= limit:
        # vLLM's reason for a full queue
        engine.stat_loggers.record_admission_rejection("max_num_queued_reqs")
        raise APIError(
            503,
            f"the server is saturated: {pending} requests unfinished, {sends} messages queued "
            f"for the engine (server limit max_pending_requests={limit}); retry later",
        )
