"""Routes a vLLM user may call that are not served here, each answered with what is
missing and how to turn it on, rather than a bare "Not Found"."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from enginecore.config import ServerConfig
from enginecore.server.errors import error_response

SLEEP_ROUTES = {"/sleep": "POST", "/wake_up": "POST", "/is_sleeping": "GET"}
DEV_ROUTES = {
    "/pause": "POST",
    "/resume": "POST",
    "/is_paused": "GET",
    "/reset_prefix_cache": "POST",
}
AUDIO_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech")
#: vLLM's other routes with no counterpart here, each with what a caller can use instead.
UNSERVED_ROUTES = {
    "/classify": "classification models are not supported (pooling models serve "
    "/v1/embeddings, /score and /rerank)",
    "/v1/messages": "Anthropic's Messages API is not served; use /v1/chat/completions",
    "/start_profile": "profile with the trace_next_steps worker RPC (enginecore rpc; traces in --trace-dir)",
    "/stop_profile": "profile with the trace_next_steps worker RPC (enginecore rpc; traces in --trace-dir)",
}


def dev_endpoints_on(server: ServerConfig) -> bool:
    """``enable_dev_endpoints``, or vLLM's own switch for them."""
    return server.enable_dev_endpoints or os.environ.get("VLLM_SERVER_DEV_MODE") == "1"


def _answer(status: int, message: str) -> object:
    async def route() -> JSONResponse:
        return error_response(status, message)

    return route


def absent_router(server: ServerConfig) -> APIRouter:
    """404s naming the flag for the control routes left off, 501s for audio and vLLM's
    other routes that have no counterpart here."""
    router = APIRouter()
    missing: list[tuple[dict[str, str], str]] = []
    if not server.enable_sleep_mode:
        missing.append((SLEEP_ROUTES, "--enable-sleep-mode (config server.enable_sleep_mode)"))
    if not dev_endpoints_on(server):
        flag = (
            "--enable-dev-endpoints (config server.enable_dev_endpoints, or VLLM_SERVER_DEV_MODE=1)"
        )
        missing.append((DEV_ROUTES, flag))
    for routes, flag in missing:
        for path, method in routes.items():
            message = f"{method} {path} is served only when the server starts with {flag}"
            router.add_api_route(path, _answer(404, message), methods=[method])  # type: ignore[arg-type]
    for path in AUDIO_ROUTES:
        message = f"POST {path}: audio models are not supported; enginecore serves text models"
        router.add_api_route(path, _answer(501, message), methods=["POST"])  # type: ignore[arg-type]
    for path, why in UNSERVED_ROUTES.items():
        router.add_api_route(path, _answer(501, f"POST {path}: {why}"), methods=["POST"])  # type: ignore[arg-type]
    return router
