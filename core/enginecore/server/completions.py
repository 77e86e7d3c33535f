"""``POST /v1/completions``: text completion, streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from enginecore.engine.output import OutputKind, RequestOutput
from enginecore.errors import EngineCoreError
from enginecore.server.beam import beam_search_output, beam_search_params, single
from enginecore.server.context import ServerContext, context
from enginecore.server.dp_rank import requested_rank
from enginecore.server.errors import APIError, error_body, status_of
from enginecore.server.limits import tokenize_prompts
from enginecore.server.logprobs import (
    completion_logprobs,
    concat_logprobs,
    echoed_prompt_logprobs,
    raw_prompt_logprobs,
)
from enginecore.server.protocol import CompletionRequest, usage
from enginecore.server.sampling import (
    check_max_tokens,
    resolve_logprob_fields,
    to_sampling_params,
    truncate_prompt,
)
from enginecore.server.stream_buffer import buffered
from enginecore.server.streaming import (
    DONE,
    SSE_HEADERS,
    ClientDisconnected,
    merge_streams,
    sse,
    unless_disconnected,
)

router = APIRouter()


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _engine_prompt(
    ctx: ServerContext, body: CompletionRequest, encoded: dict[str, Any]
) -> dict[str, Any]:
    """``truncate_prompt_tokens`` and the ``max_tokens`` check on a tokenized prompt
    (``tokenize_prompts``); a truncated prompt keeps only its ids (``echo`` decodes them)."""
    engine = ctx.engine
    text = encoded.get("prompt")
    ids = encoded["prompt_token_ids"]
    kept = truncate_prompt(
        ids, body.truncate_prompt_tokens, engine.max_model_len, body.truncation_side
    )
    if len(kept) != len(ids):
        text = None
    if 0 < len(kept) < engine.max_model_len:  # else the engine names the prompt's fault
        check_max_tokens(body.max_tokens, len(kept), engine.max_model_len)
    return (
        {"prompt": text, "prompt_token_ids": kept}
        if text is not None
        else {"prompt_token_ids": kept}
    )


def _num_candidates(body: CompletionRequest, max_n: int) -> int:
    """``best_of``: how many samples to draw for each prompt (``n`` without it)."""
    if body.suffix is not None:
        raise APIError(
            400,
            "suffix is not supported: no model served here fills in the middle",
            param="suffix",
        )
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({body.n})", param="best_of")
    if best_of > max_n:
        raise APIError(400, f"best_of must be at most {max_n}, got {best_of}", param="best_of")
    if body.stream and best_of != body.n:
        raise APIError(
            400,
            "best_of must equal n when streaming (the best are known only at the end)",
            param="best_of",
        )
    return best_of


def _best(output: RequestOutput, n: int) -> list[Any]:
    """The ``n`` candidates with the highest cumulative logprob, re-indexed from 0."""
    ranked = sorted(output.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
    ranked.sort(key=lambda c: c.index)
    for index, completion in enumerate(ranked):
        completion.index = index
    return ranked


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None
    return last


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    ctx = context(request)
    engine = ctx.engine
    lora = ctx.resolve_model(body.model)
    if lora is not None and body.use_beam_search:
        raise APIError(400, "beam search is not served with LoRA adapters", param="model")
    resolve_logprob_fields(body, ctx.limits, ctx.vocab_size)
    params = to_sampling_params(
        body,
        ctx.limits,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        vocab_size=ctx.vocab_size,
        defaults=ctx.sampling_defaults,
    )
    candidates = _num_candidates(body, ctx.limits.max_n)
    if candidates != body.n:
        # Ranking needs each candidate's cumulative logprob, which logprobs=0 yields.
        logprobs = 0 if body.logprobs is None else body.logprobs
        if params.logprob_token_ids:  # the listed ids' count already yields them
            logprobs = len(params.logprob_token_ids)
        params = params.clone(n=candidates, logprobs=logprobs)
    prompt_logprobs = _prompt_logprobs(body)
    if prompt_logprobs is not None:
        params = params.clone(prompt_logprobs=prompt_logprobs)
    encoded = await tokenize_prompts(engine.tokenizer, _prompts(body.prompt), ctx.limits)
    prompts = [_engine_prompt(ctx, body, p) for p in encoded]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.use_beam_search:
        return await _beam_search(ctx, body, request, request_id, created, prompts, candidates)
    kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
    collectors = []
    rank = requested_rank(body, request)
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            collectors.append(
                engine.add_request(
                    rid,
                    prompt,
                    params,
                    priority=body.priority,
                    output_kind=kind,
                    data_parallel_rank=rank,
                    lora_request=lora,
                )
            )
    except BaseException:
        engine.abort([c.request_id for c in collectors])
        raise
    if body.stream:
        streams = [buffered(body, engine.stream(c)) for c in collectors]
        return StreamingResponse(
            _stream(ctx, body, request_id, created, streams),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    finals = [_final(engine.stream(c)) for c in collectors]
    try:
        outputs = await unless_disconnected(request, asyncio.gather(*finals))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, body, request_id, created, outputs))


async def _beam_search(
    ctx: ServerContext,
    body: CompletionRequest,
    request: Request,
    request_id: str,
    created: int,
    prompts: list[dict[str, Any]],
    beam_width: int,
) -> Response:
    """``use_beam_search``: each prompt's best ``n`` beams are its choices."""
    engine = ctx.engine
    searches = []
    for i, prompt in enumerate(prompts):
        ids = prompt["prompt_token_ids"]
        room = engine.max_model_len - len(ids)
        max_tokens = room if body.max_tokens is None else min(body.max_tokens, room)
        params = beam_search_params(
            body,
            beam_width=beam_width,
            max_tokens=max(max_tokens, 1),
            logprobs=body.logprobs is not None,
        )
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        searches.append(beam_search_output(engine, rid, ids, params, body.n, body.priority))
    if body.stream:
        streams = [single(search) for search in searches]
        return StreamingResponse(
            _stream(ctx, body, request_id, created, streams),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        outputs = await unless_disconnected(request, asyncio.gather(*searches))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, body, request_id, created, outputs))


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """vLLM's rule: ``echo`` with ``logprobs`` returns the prompt tokens' logprobs too."""
    wanted = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        wanted = body.logprobs if wanted is None else max(wanted, body.logprobs)
    return wanted


def _echo_logprobs(
    ctx: ServerContext, body: CompletionRequest, output: RequestOutput
) -> dict[str, Any] | None:
    """The prompt's logprobs that lead an echoed choice's logprobs."""
    if not body.echo or body.logprobs is None or output.prompt_logprobs is None:
        return None
    return echoed_prompt_logprobs(
        output.prompt_token_ids,
        output.prompt_logprobs,
        body.logprobs,
        ctx.engine.tokenizer,
        body.return_tokens_as_token_ids,
    )


def _prompt_text(ctx: ServerContext, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    prompt: str = ctx.engine.tokenizer.decode(output.prompt_token_ids)
    return prompt


def _response(
    ctx: ServerContext,
    body: CompletionRequest,
    request_id: str,
    created: int,
    outputs: list[RequestOutput],
) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = cached_tokens = 0
    for p_index, output in enumerate(outputs):
        prompt_tokens += len(output.prompt_token_ids)
        cached_tokens += output.num_cached_tokens
        prefix = _prompt_text(ctx, output) if body.echo else ""
        echoed = _echo_logprobs(ctx, body, output)
        completion_tokens += sum(len(c.token_ids) for c in output.outputs)  # all candidates
        for completion in _best(output, body.n):
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs = completion_logprobs(
                    completion.logprobs,
                    body.logprobs,
                    ctx.engine.tokenizer,
                    len(prefix),
                    body.return_tokens_as_token_ids,
                    body.logprob_token_ids,
                )
            if echoed is not None:
                logprobs = concat_logprobs(echoed, logprobs)
            choice = {
                "index": p_index * body.n + completion.index,
                "text": prefix + completion.text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if body.prompt_logprobs is not None and output.prompt_logprobs is not None:
                choice["prompt_logprobs"] = raw_prompt_logprobs(output.prompt_logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"] = output.prompt_token_ids
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.response_model(body.model),
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        # Disaggregated prefill: the handle the decode instance needs (one prompt only).
        "kv_transfer_params": outputs[0].kv_transfer_params if len(outputs) == 1 else None,
    }


async def _stream(
    ctx: ServerContext,
    body: CompletionRequest,
    request_id: str,
    created: int,
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[str]:
    options = body.stream_options
    include_usage = ctx.limits.enable_force_include_usage or bool(options and options.include_usage)
    continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
    engine = ctx.engine
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    completion_tokens = 0
    offsets: dict[int, int] = {}
    base = {"id": request_id, "object": "text_completion", "created": created}
    base["model"] = ctx.response_model(body.model)
    try:
        async for p_index, output in merge_streams(streams):
            prompt_tokens[p_index] = len(output.prompt_token_ids)
            cached_tokens[p_index] = output.num_cached_tokens
            for completion in output.outputs:
                index = p_index * body.n + completion.index
                text = completion.text
                echoed = None
                first = index not in offsets
                if body.echo and first:
                    text = _prompt_text(ctx, output) + text
                    echoed = _echo_logprobs(ctx, body, output)
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(text)
                completion_tokens += len(completion.token_ids)
                if not text and not completion.token_ids and not completion.finish_reason:
                    continue
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    start = offset + (len(text) - len(completion.text))
                    logprobs = completion_logprobs(
                        completion.logprobs,
                        body.logprobs,
                        engine.tokenizer,
                        start,
                        body.return_tokens_as_token_ids,
                        body.logprob_token_ids,
                    )
                if echoed is not None:
                    logprobs = concat_logprobs(echoed, logprobs)
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
                if body.return_token_ids:
                    if first:
                        choice["prompt_token_ids"] = output.prompt_token_ids
                    choice["token_ids"] = completion.token_ids
                # One choice per chunk, as OpenAI and vLLM stream them.
                chunk = {**base, "choices": [choice]}
                if continuous_usage:
                    chunk["usage"] = usage(
                        sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values())
                    )
                elif include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if include_usage:
            total_prompt = sum(prompt_tokens.values())
            final = usage(total_prompt, completion_tokens, sum(cached_tokens.values()))
            yield sse({**base, "choices": [], "usage": final})
    except EngineCoreError as exc:
        yield sse(error_body(status_of(exc), str(exc)))
    yield DONE
