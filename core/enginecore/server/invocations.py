"""``POST /invocations``: SageMaker's one entry point, as vLLM serves it. The body's shape
picks the API: ``messages`` is a chat completion, ``prompt`` a completion; each is then
validated and served exactly as on its own route."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from enginecore.server import chat, completions
from enginecore.server.errors import APIError
from enginecore.server.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    try:
        data: Any = json.loads(await request.body())
    except ValueError:
        raise APIError(400, "POST /invocations takes a JSON body") from None
    try:
        if isinstance(data, dict) and "messages" in data:
            return await chat.create_chat_completion(
                ChatCompletionRequest.model_validate(data), request
            )
        if isinstance(data, dict) and "prompt" in data:
            return await completions.create_completion(
                CompletionRequest.model_validate(data), request
            )
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    raise APIError(
        400,
        "POST /invocations takes a chat completions body (with 'messages') or a "
        "completions body (with 'prompt')",
    )
