"""``POST /v1/completions``: text completion, streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from enginecore.config import ServerConfig
from enginecore.engine.output import OutputKind, RequestOutput
from enginecore.errors import EngineCoreError
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
from enginecore.server.sampling import check_model, check_prompt_logprobs, to_sampling_params
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
    check_model(body.model, ctx.model_name, ctx.model_path)
    params = to_sampling_params(
        body,
        ctx.limits,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        vocab_size=ctx.vocab_size,
    )
    prompt_logprobs = _prompt_logprobs(body, ctx.limits)
    if prompt_logprobs is not None:
        params = params.clone(prompt_logprobs=prompt_logprobs)
    prompts = await tokenize_prompts(engine.tokenizer, _prompts(body.prompt), ctx.limits)
    request_id = f"cmpl-{uuid.uuid4().hex}"
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
                )
            )
    except BaseException:
        engine.abort([c.request_id for c in collectors])
        raise
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _stream(ctx, body, request_id, created, collectors),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    finals = [_final(engine.stream(c)) for c in collectors]
    try:
        outputs = await unless_disconnected(request, asyncio.gather(*finals))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, body, request_id, created, outputs))


def _prompt_logprobs(body: CompletionRequest, limits: ServerConfig) -> int | None:
    """vLLM's rule: ``echo`` with ``logprobs`` returns the prompt tokens' logprobs too."""
    wanted = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        wanted = body.logprobs if wanted is None else max(wanted, body.logprobs)
    return check_prompt_logprobs(wanted, limits)


def _echo_logprobs(
    ctx: ServerContext, body: CompletionRequest, output: RequestOutput
) -> dict[str, Any] | None:
    """The prompt's logprobs that lead an echoed choice's logprobs."""
    if not body.echo or body.logprobs is None or output.prompt_logprobs is None:
        return None
    return echoed_prompt_logprobs(
        output.prompt_token_ids, output.prompt_logprobs, body.logprobs, ctx.engine.tokenizer
    )


def _prompt_text(ctx: ServerContext, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return ctx.engine.tokenizer.decode(output.prompt_token_ids)


def _response(
    ctx: ServerContext,
    body: CompletionRequest,
    request_id: str,
    created: int,
    outputs: list[RequestOutput],
) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for p_index, output in enumerate(outputs):
        prompt_tokens += len(output.prompt_token_ids)
        prefix = _prompt_text(ctx, output) if body.echo else ""
        echoed = _echo_logprobs(ctx, body, output)
        for completion in output.outputs:
            completion_tokens += len(completion.token_ids)
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs = completion_logprobs(
                    completion.logprobs, body.logprobs, ctx.engine.tokenizer, len(prefix)
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
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
        # Disaggregated prefill: the handle the decode instance needs (one prompt only).
        "kv_transfer_params": outputs[0].kv_transfer_params if len(outputs) == 1 else None,
    }


async def _stream(
    ctx: ServerContext,
    body: CompletionRequest,
    request_id: str,
    created: int,
    collectors: list,
) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    engine = ctx.engine
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    offsets: dict[int, int] = {}
    base = {"id": request_id, "object": "text_completion", "created": created}
    base["model"] = ctx.model_name
    try:
        streams = [engine.stream(c) for c in collectors]
        async for p_index, output in merge_streams(streams):
            prompt_tokens[p_index] = len(output.prompt_token_ids)
            choices = []
            for completion in output.outputs:
                index = p_index * body.n + completion.index
                text = completion.text
                echoed = None
                if body.echo and index not in offsets:
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
                        completion.logprobs, body.logprobs, engine.tokenizer, start
                    )
                if echoed is not None:
                    logprobs = concat_logprobs(echoed, logprobs)
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
            if choices:
                chunk = {**base, "choices": choices}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if include_usage:
            total_prompt = sum(prompt_tokens.values())
            yield sse({**base, "choices": [], "usage": usage(total_prompt, completion_tokens)})
    except EngineCoreError as exc:
        yield sse(error_body(status_of(exc), str(exc)))
    yield DONE
