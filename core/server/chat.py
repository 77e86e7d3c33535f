"""``POST /v1/chat/completions``: the tokenizer's chat template, then generation."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from enginecore.engine.output import OutputKind, RequestOutput
from enginecore.errors import EngineCoreError
from enginecore.server.context import ServerContext, context
from enginecore.server.dp_rank import requested_rank
from enginecore.server.errors import APIError, error_body, status_of
from enginecore.server.logprobs import chat_logprobs
from enginecore.server.protocol import ChatCompletionRequest, ChatMessage, usage
from enginecore.server.sampling import check_model, to_sampling_params
from enginecore.server.streaming import (
    DONE,
    SSE_HEADERS,
    ClientDisconnected,
    sse,
    unless_disconnected,
)

router = APIRouter()


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined into one string."""
    result = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{i}].content: only text parts are supported",
                        param="messages",
                    )
                texts.append(part["text"])
            data["content"] = "".join(texts)
        elif content is None:
            data["content"] = ""
        result.append(data)
    return result


def chat_prompt_ids(ctx: ServerContext, body: Any) -> list[int]:
    return ctx.engine.chat_prompt(
        message_dicts(body.messages),
        chat_template=body.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        chat_template_kwargs=body.chat_template_kwargs,
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = context(request)
    engine = ctx.engine
    check_model(body.model, ctx.model_name, ctx.model_path)
    num_top = None
    if body.logprobs:
        num_top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = to_sampling_params(
        body, ctx.limits, max_tokens=max_tokens, logprobs=num_top, vocab_size=ctx.vocab_size
    )
    prompt_ids = chat_prompt_ids(ctx, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
    collector = engine.add_request(
        request_id,
        {"prompt_token_ids": prompt_ids},
        params,
        priority=body.priority,
        output_kind=kind,
        data_parallel_rank=requested_rank(body, request),
    )
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _stream(ctx, body, request_id, created, collector, num_top),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def final() -> RequestOutput:
        last = None
        async for output in engine.stream(collector):
            last = output
        return last

    try:
        output = await unless_disconnected(request, final())
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, request_id, created, output, num_top))


def _response(
    ctx: ServerContext, request_id: str, created: int, output: RequestOutput, num_top: int | None
) -> dict[str, Any]:
    choices = []
    completion_tokens = 0
    for completion in output.outputs:
        completion_tokens += len(completion.token_ids)
        logprobs = None
        if num_top is not None and completion.logprobs is not None:
            logprobs = chat_logprobs(completion.logprobs, num_top, ctx.engine.tokenizer)
        choices.append(
            {
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    prompt_tokens = len(output.prompt_token_ids)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


async def _stream(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    collector: Any,
    num_top: int | None,
) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": ctx.model_name,
    }

    def chunk(choices: list[dict[str, Any]]) -> str:
        data = {**base, "choices": choices}
        if include_usage:
            data["usage"] = None
        return sse(data)

    prompt_tokens = completion_tokens = 0
    try:
        # The role comes first, for every choice, before any token is generated.
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(body.n)
            ]
        )
        async for output in ctx.engine.stream(collector):
            prompt_tokens = len(output.prompt_token_ids)
            choices = []
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                if not (completion.text or completion.token_ids or completion.finish_reason):
                    continue
                logprobs = None
                if num_top is not None and completion.logprobs:
                    logprobs = chat_logprobs(completion.logprobs, num_top, ctx.engine.tokenizer)
                delta = {"content": completion.text} if completion.text else {}
                choices.append(
                    {
                        "index": completion.index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": completion.finish_reason,
                    }
                )
            if choices:
                yield chunk(choices)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except EngineCoreError as exc:
        yield sse(error_body(status_of(exc), str(exc)))
    yield DONE
