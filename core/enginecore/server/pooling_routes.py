"""Pooling routes, as vLLM serves them: ``POST /v1/embeddings`` (OpenAI's shape),
``/pooling``, ``/score`` and ``/v1/score``, ``/rerank``, ``/v1/rerank`` and ``/v2/rerank``.

Each input is one engine request with :class:`~enginecore.pooling.PoolingParams`; the
engine must run the ``pooling`` runner (``--runner pooling`` / ``--task embed``), else
every route answers 400. An embedding model scores a pair by the cosine similarity of
the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from enginecore.engine.output import OutputKind, RequestOutput
from enginecore.engine.pooling_api import cosine_similarity
from enginecore.errors import InvalidRequestError
from enginecore.params import SamplingParams
from enginecore.pooling import PoolerConfig, PoolingParams, checkpoint_pooler_config
from enginecore.server.client_quota import client_fields
from enginecore.server.context import ServerContext, context
from enginecore.server.errors import APIError
from enginecore.server.limits import tokenize_prompts
from enginecore.server.protocol import _StrictBody
from enginecore.server.sampling import check_model, truncate_prompt
from enginecore.server.streaming import ClientDisconnected, unless_disconnected

router = APIRouter()

Inputs = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_StrictBody):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0


class ScoreRequest(_StrictBody):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(_StrictBody):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


@functools.lru_cache(maxsize=8)
def _pooler_config(path: str) -> PoolerConfig:
    return checkpoint_pooler_config(path)


def _check_pooling_model(ctx: ServerContext) -> PoolerConfig:
    if not ctx.config.model.is_pooling:
        raise APIError(
            400,
            "this model generates text; embeddings, pooling, score and rerank need a server "
            "started with --runner pooling (or --task embed)",
        )
    return _pooler_config(ctx.model_path)


def _inputs(value: Inputs) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input must not be empty", param="input")
    if all(isinstance(t, int) for t in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


async def _pool(
    ctx: ServerContext,
    request: Request,
    prompts: list[str | list[int]],
    params: PoolingParams,
    *,
    truncate: int | None,
    priority: int,
    prefix: str,
) -> tuple[str, list[RequestOutput]]:
    """Run each prompt as a pooling request; outputs in input order."""
    engine = ctx.engine
    encoded = await tokenize_prompts(engine.tokenizer, prompts, ctx.limits)
    vocab = ctx.vocab_size
    for i, item in enumerate(encoded):
        ids = truncate_prompt(item["prompt_token_ids"], truncate, engine.max_model_len)
        if not ids:
            raise APIError(400, f"input {i} is empty", param="input")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"input {i} has token ids outside [0, {vocab})", param="input")
        item.clear()
        item["prompt_token_ids"] = ids
    sampling = SamplingParams(max_tokens=1, pooling=params, extra=client_fields() or None)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    collectors = []
    try:
        for i, prompt in enumerate(encoded):
            collectors.append(
                engine.add_request(
                    f"{request_id}-{i}",
                    prompt,
                    sampling,
                    priority=priority,
                    output_kind=OutputKind.FINAL_ONLY,
                )
            )
    except InvalidRequestError as exc:
        engine.abort([c.request_id for c in collectors])
        raise APIError(400, str(exc)) from None
    except BaseException:
        engine.abort([c.request_id for c in collectors])
        raise

    async def final(collector: Any) -> RequestOutput:
        last: RequestOutput | None = None
        async for output in engine.stream(collector):
            last = output
        if last is None or last.pooled is None:
            raise APIError(500, f"request {collector.request_id} finished without a vector")
        return last

    outputs = await unless_disconnected(request, asyncio.gather(*(final(c) for c in collectors)))
    return request_id, list(outputs)


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def _listing(ctx: ServerContext, request_id: str, data: list[Any], outputs: Any) -> JSONResponse:
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": ctx.model_name,
            "data": data,
            "usage": _usage(outputs),
        }
    )


async def _vectors(
    body: EmbeddingRequest, request: Request, task: Literal["embed", "encode"], prefix: str
) -> tuple[ServerContext, str, list[RequestOutput]]:
    ctx = context(request)
    check_model(body.model, ctx.model_name, ctx.model_path, ctx.model_aliases)
    pooler = _check_pooling_model(ctx)
    try:
        pooler.check_dimensions(body.dimensions)
        params = PoolingParams(task=task, normalize=body.normalize, dimensions=body.dimensions)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="dimensions") from None
    request_id, outputs = await _pool(
        ctx,
        request,
        _inputs(body.input),
        params,
        truncate=body.truncate_prompt_tokens,
        priority=body.priority,
        prefix=prefix,
    )
    return ctx, request_id, outputs


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    try:
        ctx, request_id, outputs = await _vectors(body, request, "embed", "embd")
    except ClientDisconnected:
        return Response(status_code=499)
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": _encode(o.pooled or [], body.encoding_format),
        }
        for i, o in enumerate(outputs)
    ]
    return _listing(ctx, request_id, data, outputs)


@router.post("/pooling")
async def create_pooling(body: EmbeddingRequest, request: Request) -> Response:
    try:
        ctx, request_id, outputs = await _vectors(body, request, "encode", "pool")
    except ClientDisconnected:
        return Response(status_code=499)
    data = [
        {"index": i, "object": "pooling", "data": _encode(o.pooled or [], body.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    return _listing(ctx, request_id, data, outputs)


async def _scores(
    ctx: ServerContext,
    request: Request,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    priority: int,
    prefix: str,
) -> tuple[str, list[float], list[RequestOutput]]:
    """Each distinct text embedded once; each pair scored by cosine similarity."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    request_id, outputs = await _pool(
        ctx,
        request,
        list(texts),
        PoolingParams(task="embed"),
        truncate=truncate,
        priority=priority,
        prefix=prefix,
    )
    vectors = {t: o.pooled or [] for t, o in zip(texts, outputs, strict=True)}
    return request_id, [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs], outputs


def _pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    left = [first] if isinstance(first, str) else list(first)
    right = [second] if isinstance(second, str) else list(second)
    if not left or not right:
        raise APIError(400, "text_1 and text_2 must not be empty")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise APIError(
            400,
            f"text_1 is one text or as many as text_2 (1:N or N:N); got {len(left)} and "
            f"{len(right)}",
            param="text_1",
        )
    return list(zip(left, right, strict=True))


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> Response:
    ctx = context(request)
    check_model(body.model, ctx.model_name, ctx.model_path, ctx.model_aliases)
    _check_pooling_model(ctx)
    pairs = _pairs(body.text_1, body.text_2)
    try:
        request_id, scores, outputs = await _scores(
            ctx, request, pairs, body.truncate_prompt_tokens, body.priority, "score"
        )
    except ClientDisconnected:
        return Response(status_code=499)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return _listing(ctx, request_id, data, outputs)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request) -> Response:
    ctx = context(request)
    check_model(body.model, ctx.model_name, ctx.model_path, ctx.model_aliases)
    _check_pooling_model(ctx)
    if not body.documents:
        raise APIError(400, "documents must not be empty", param="documents")
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be >= 1, got {body.top_n}", param="top_n")
    pairs = [(body.query, d) for d in body.documents]
    try:
        request_id, scores, outputs = await _scores(
            ctx, request, pairs, body.truncate_prompt_tokens, body.priority, "rerank"
        )
    except ClientDisconnected:
        return Response(status_code=499)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = []
    for i in ranked:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        results.append(item)
    tokens = _usage(outputs)["total_tokens"]
    return JSONResponse(
        {
            "id": request_id,
            "model": ctx.model_name,
            "results": results,
            "usage": {"total_tokens": tokens},
        }
    )
