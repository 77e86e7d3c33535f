"""``enginecore disagg-proxy``: an OpenAI-compatible router for disaggregated prefill/decode.

Each completion or chat request goes first to a *prefill* instance (``kv_producer``)
with ``max_tokens=1``, no streaming and ``kv_transfer_params={"do_remote_decode":
true}``; the prefill response's ``kv_transfer_params`` (where and under which id its
KV blocks wait) are added to the original request, which then goes to a *decode*
instance (``kv_consumer``). The decode answer, streamed or not, is the client's answer.
Several instances of either kind are used round-robin. See docs/kv_transfer.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "x-request-id")


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "proxy_error", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _one_sequence(body: dict[str, Any]) -> bool:
    """True when the request makes one sequence: one prompt, ``n`` of 1."""
    if body.get("n", 1) not in (1, None):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt) == 1  # a list of prompts (strings or token lists)
    return True


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout: float = 600.0) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("disagg-proxy needs at least one --prefill and one --decode URL")
    prefill_cycle = itertools.cycle([u.rstrip("/") for u in prefill_urls])
    decode_cycle = itertools.cycle([u.rstrip("/") for u in decode_urls])
    client = httpx.AsyncClient(timeout=timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="enginecore disaggregated prefill/decode proxy", lifespan=lifespan)

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}

    async def route(request: Request, path: str, token_fields: tuple[str, ...]) -> Response:
        try:
            body: dict[str, Any] = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = headers_of(request)
        if not _one_sequence(body):
            # Several prompts or n > 1: one handoff cannot cover them; decode computes all.
            return await forward(next(decode_cycle), path, body, headers)
        prefill = dict(body, stream=False, kv_transfer_params={"do_remote_decode": True})
        prefill.pop("stream_options", None)
        for name in token_fields:
            prefill[name] = 1
        prefill_url = next(prefill_cycle)
        try:
            answer = await client.post(prefill_url + path, json=prefill, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill instance {prefill_url} unreachable: {exc}")
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json")
        decode = dict(body, kv_transfer_params=answer.json().get("kv_transfer_params"))
        return await forward(next(decode_cycle), path, decode, headers)

    async def forward(
        decode_url: str, path: str, decode: dict[str, Any], headers: dict[str, Any]
    ) -> Response:
        """The decode instance's answer, streamed or not, as the client's answer."""
        if decode.get("stream"):
            upstream = client.build_request("POST", decode_url + path, json=decode, headers=headers)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                return _error(502, f"decode instance {decode_url} unreachable: {exc}")

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()

            return StreamingResponse(
                relay(),
                status_code=response.status_code,
                media_type=response.headers.get("content-type", "text/event-stream"),
            )
        try:
            result = await client.post(decode_url + path, json=decode, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance {decode_url} unreachable: {exc}")
        return Response(result.content, result.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions", ("max_tokens",))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(request, "/v1/chat/completions", ("max_tokens", "max_completion_tokens"))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = next(decode_cycle)
        try:
            answer = await client.get(url + "/v1/models", headers=headers_of(request))
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance {url} unreachable: {exc}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for url in [*prefill_urls, *decode_urls]:
            try:
                answer = await client.get(url.rstrip("/") + "/health")
            except httpx.HTTPError as exc:
                return _error(503, f"{url} unreachable: {exc}")
            if answer.status_code != 200:
                return _error(503, f"{url} is unhealthy ({answer.status_code})")
        return Response(status_code=200)

    return app


def run(prefill_urls: list[str], decode_urls: list[str], host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(prefill_urls, decode_urls), host=host, port=port, log_level="warning")
