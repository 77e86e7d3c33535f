"""The OpenAI-compatible HTTP app: ``build_app(config)`` (``enginecore serve`` runs it
through :mod:`enginecore.server.launch`). The ``prometheus`` stat logger is always added:
it feeds ``/metrics``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from enginecore.config import EngineConfig
from enginecore.server import (
    chat,
    completions,
    control,
    info,
    invocations,
    load,
    lora_models,
    pooling_routes,
    responses,
)
from enginecore.server.absent import absent_router, dev_endpoints_on
from enginecore.server.client_quota import ClientQuota
from enginecore.server.context import ServerContext
from enginecore.server.errors import install_error_handlers
from enginecore.server.launch import check_tool_config, server_config
from enginecore.server.limits import check_body_limits, check_capacity
from enginecore.server.lora_models import LoRAModels, runtime_updating_allowed
from enginecore.server.security import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuardMiddleware,
    default_allowed_hosts,
)
from enginecore.server.unknown_fields import UnknownFieldsPolicyMiddleware
from enginecore.version import __version__

logger = logging.getLogger("enginecore.server")


def build_app(config: EngineConfig, engine: Any = None) -> FastAPI:
    """The ASGI app. Without ``engine``, its lifespan starts (and stops) an AsyncLLM."""
    config = server_config(config)
    ctx = ServerContext(config=config, engine=engine, loras=LoRAModels(config))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        owned = None
        if ctx.engine is None:
            from enginecore.engine.async_llm import AsyncLLM

            owned = ctx.engine = AsyncLLM(config=config)
        try:
            check_tool_config(config, getattr(ctx.engine, "plugins", None))
            if owned is not None:
                log_startup(ctx)
            yield
        finally:
            if owned is not None:
                owned.shutdown()

    app = FastAPI(
        title="enginecore",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.ctx = ctx
    app.state.server_load = load.ServerLoad()
    install_error_handlers(app)
    limited = [Depends(check_body_limits)]
    app.include_router(info.router, dependencies=limited)
    app.include_router(load.router)
    generation = [*limited, Depends(check_capacity)]
    app.include_router(completions.router, dependencies=generation)
    app.include_router(chat.router, dependencies=generation)
    app.include_router(pooling_routes.router, dependencies=generation)
    app.include_router(invocations.router, dependencies=generation)
    app.include_router(responses.router, dependencies=limited)  # its POST: + check_capacity
    if config.server.enable_sleep_mode:
        app.include_router(control.sleep_router, dependencies=limited)
    if dev_endpoints_on(config.server):
        app.include_router(control.dev_router, dependencies=limited)
    app.include_router(absent_router(config.server), dependencies=limited)
    if runtime_updating_allowed(config):
        logger.warning("LoRA adapters may be loaded and unloaded at run time")
        app.include_router(lora_models.router, dependencies=limited)
    if config.server.enable_collective_rpc_endpoint:
        logger.warning("POST /collective_rpc is enabled: clients can call worker methods by name")
        app.include_router(control.rpc_router, dependencies=limited)
    # Outermost first: browser checks (Host, Origin, Content-Type), CORS answers, the
    # size limit, the key check, then the routes (add_middleware wraps: last is outermost).
    server = config.server
    app.add_middleware(
        ClientQuota,
        limit=server.max_pending_requests_per_client,
        rank_requests=config.scheduler.policy == "fair_share",
    )
    if server.enable_server_load_tracking:
        app.add_middleware(load.LoadTrackingMiddleware, load=app.state.server_load)
    app.add_middleware(UnknownFieldsPolicyMiddleware, policy=server.unknown_request_fields)
    if server.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.api_key)
    app.add_middleware(BodySizeLimitMiddleware, limit=server.max_request_body_bytes)
    if server.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=server.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    allowed_hosts = server.allowed_hosts
    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(server.host)
    app.add_middleware(
        BrowserGuardMiddleware,
        allowed_hosts=allowed_hosts,
        allowed_origins=server.allowed_origins,
    )
    return app


def log_startup(ctx: ServerContext) -> None:
    engine = ctx.engine
    ready = engine.ready
    components = ", ".join(f"{kind}={value}" for kind, value in engine.components.items())
    logger.info(
        "enginecore %s: model %r served as %r; max_model_len %d; %d KV blocks of %d tokens; "
        "components: %s",
        __version__,
        ctx.model_path,
        ctx.model_name,
        ready.max_model_len,
        ready.num_blocks,
        ready.block_size,
        components,
    )
    server = ctx.config.server
    logger.info(
        "API key %s; request body limit %d bytes; n <= %d; logprobs <= %d; max_tokens <= %s",
        "required on /v1 and control routes" if server.api_key else "not set (open server)",
        server.max_request_body_bytes,
        server.max_n,
        server.max_logprobs,
        server.max_tokens_limit if server.max_tokens_limit is not None else "max_model_len",
    )
