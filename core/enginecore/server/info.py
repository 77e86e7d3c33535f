"""Read-only endpoints: ``/health``, ``/metrics``, ``/version``, ``/v1/models``,
``/tokenize``, ``/detokenize`` and ``/tokenizer_info``."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import prometheus_client
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from enginecore.errors import EngineCoreError
from enginecore.server.chat import chat_prompt_ids
from enginecore.server.context import context
from enginecore.server.errors import error_response
from enginecore.server.protocol import DetokenizeRequest, TokenizeRequest
from enginecore.server.sampling import check_model
from enginecore.version import __version__

router = APIRouter()

_STARTED = int(time.time())


#: /health and /ping answer 200 with an empty body (what probes expect), as documented.
_PROBE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the engine answers"},
    503: {"description": "it does not"},
}


@router.get("/health", response_class=Response, responses=_PROBE_RESPONSES)
async def health(request: Request) -> Response:
    """200 while the engine core answers; 503 once it is dead (or does not answer)."""
    try:
        await context(request).engine.check_health()
    except EngineCoreError as exc:
        return error_response(503, f"the engine is not healthy: {exc}")
    return Response(status_code=200)


@router.get("/ping", response_class=Response, responses=_PROBE_RESPONSES)
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the ``enginecore:*`` metrics (and process metrics)."""
    # The steps' records reach the loggers without the step waiting; a scrape counts
    # every step finished before it (waited for off the event loop, bounded).
    stat_loggers = getattr(context(request).engine, "stat_loggers", None)
    if stat_loggers is not None:
        await asyncio.to_thread(stat_loggers.flush)
    registry = prometheus_client.REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # several API servers: all of theirs
        from prometheus_client import multiprocess

        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return Response(
        prometheus_client.generate_latest(registry),
        media_type=prometheus_client.CONTENT_TYPE_LATEST,
    )


@router.get("/version")
async def version() -> dict[str, Any]:
    """vLLM's shape exactly (clients parse it); ``enginecore plugins`` prints the plugin API
    version."""
    return {"version": __version__}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx = context(request)
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": _STARTED,
                "owned_by": "enginecore",
                "root": ctx.model_path,
                "max_model_len": ctx.engine.max_model_len,
            }
            for name in (ctx.model_name, *ctx.model_aliases)
        ]
        + (ctx.loras.model_cards(_STARTED) if ctx.loras is not None else []),
    }


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    ctx = context(request)
    check_model(body.model, ctx.model_name, ctx.model_path, ctx.model_aliases)
    engine = ctx.engine
    if (body.prompt is None) == (body.messages is None):
        return error_response(400, "give exactly one of 'prompt' and 'messages'")
    # Off the event loop: a multi-megabyte prompt takes seconds to tokenize.
    if body.messages is not None:
        tools = [t.model_dump(exclude_unset=True) for t in body.tools or []]
        tokens = await asyncio.to_thread(chat_prompt_ids, ctx, body, tools or None)
    else:
        tokens = await asyncio.to_thread(
            engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    result: dict[str, Any] = {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": engine.max_model_len,
    }
    if body.return_token_strs:
        result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(tokens)
    return JSONResponse(result)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    ctx = context(request)
    check_model(body.model, ctx.model_name, ctx.model_path, ctx.model_aliases)
    vocab = ctx.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        return error_response(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    text = await asyncio.to_thread(ctx.engine.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


def _json_ready(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    """vLLM's ``/tokenizer_info``: the tokenizer's class, its configuration and the chat
    template, for clients that tokenize on their side."""
    ctx = context(request)
    tokenizer = ctx.engine.tokenizer
    info: dict[str, Any] = {
        key: value
        for key, value in getattr(tokenizer, "init_kwargs", {}).items()
        if _json_ready(value)
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = ctx.engine.chat_template or getattr(tokenizer, "chat_template", None)
    info["vocab_size"] = ctx.vocab_size
    info["max_model_len"] = ctx.engine.max_model_len
    return JSONResponse(info)
