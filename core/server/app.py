"""The OpenAI-compatible HTTP server: ``build_app(config)`` and ``run_server(config)``.

``run_server`` starts the engine first (so a bad model or config fails before anything
listens), logs what was resolved, then serves with uvicorn on one event loop shared with
the :class:`~enginecore.AsyncLLM`. The ``prometheus`` stat logger is always added: it
feeds ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from enginecore.config import EngineConfig
from enginecore.engine.preflight import reserve_port
from enginecore.plugins import make_plugin_manager
from enginecore.server import chat, completions, control, info, lifecycle, responses
from enginecore.server.context import ServerContext
from enginecore.server.errors import install_error_handlers
from enginecore.server.limits import check_body_limits, check_capacity
from enginecore.server.security import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    BrowserGuardMiddleware,
    default_allowed_hosts,
)
from enginecore.server.tools import check_tool_config
from enginecore.server.unknown_fields import UnknownFieldsPolicyMiddleware
from enginecore.version import __version__

logger = logging.getLogger("enginecore.server")

API_KEY_ENV = "ENGINECORE_API_KEY"


def server_config(config: EngineConfig) -> EngineConfig:
    """The config the server runs: ``prometheus`` among the stat loggers, the API key from
    ``ENGINECORE_API_KEY`` when the config has none, one CPU core kept for the server."""
    changes: dict[str, Any] = {}
    loggers = list(config.observability.stat_loggers)
    if "prometheus" not in loggers:
        changes["stat_loggers"] = [*loggers, "prometheus"]
    if config.server.api_key is None and os.environ.get(API_KEY_ENV):
        changes["api_key"] = os.environ[API_KEY_ENV]
    if config.parallel.cpu_reserved_cores is None:
        changes["cpu_reserved_cores"] = 1  # the HTTP server's core (see cpu_threads_per_rank)
    return config.replace(**changes) if changes else config


def build_app(config: EngineConfig, engine: Any = None) -> FastAPI:
    """The ASGI app. Without ``engine``, its lifespan starts (and stops) an AsyncLLM."""
    config = server_config(config)
    ctx = ServerContext(config=config, engine=engine)

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
    install_error_handlers(app)
    limited = [Depends(check_body_limits)]
    app.include_router(info.router, dependencies=limited)
    generation = [*limited, Depends(check_capacity)]
    app.include_router(completions.router, dependencies=generation)
    app.include_router(chat.router, dependencies=generation)
    app.include_router(responses.router, dependencies=limited)  # its POST: + check_capacity
    app.include_router(control.router, dependencies=limited)
    if config.server.enable_collective_rpc_endpoint:
        logger.warning("POST /collective_rpc is enabled: clients can call worker methods by name")
        app.include_router(control.rpc_router, dependencies=limited)
    # Outermost first: browser checks (Host, Origin, Content-Type), CORS answers, the
    # size limit, the key check, then the routes (add_middleware wraps: last is outermost).
    server = config.server
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


def _show_info_logs() -> None:
    # The CLI's root logger defaults to WARNING; the server's own lines (start-up, the
    # periodic stats line) are INFO and meant to be seen.
    for name in ("enginecore.server", "enginecore.metrics"):
        named = logging.getLogger(name)
        if named.level == logging.NOTSET:
            named.setLevel(logging.INFO)


async def serve(config: EngineConfig) -> int:
    """Start the engine, then serve HTTP until SIGTERM/SIGINT (a drain, see
    :mod:`~enginecore.server.lifecycle`) or the engine's death; the engine stops with it.
    Returns the exit status: 0, or 1 when the engine died."""
    import uvicorn

    config = server_config(config)
    _show_info_logs()
    plugins = make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
    check_tool_config(config, plugins)  # before the engine starts: a bad name fails fast
    listener = reserve_port(config.server.host, config.server.port)
    try:
        engine = _start_engine(config, plugins)
    except BaseException:
        listener.close()
        raise
    outcome = lifecycle.Outcome()
    try:
        app = build_app(config, engine)
        log_startup(app.state.ctx)
        host, port = config.server.host, listener.getsockname()[1]  # --port 0: the one bound
        if host not in ("127.0.0.1", "localhost", "::1") and not config.server.api_key:
            logger.warning(
                "listening on %s without an API key: anyone who can reach it may use it", host
            )
        drain_timeout = config.engine.shutdown_timeout
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=config.observability.log_requests,
            # uvicorn annotates whole seconds but waits with asyncio (fractions work).
            timeout_graceful_shutdown=drain_timeout + lifecycle.GRACE_MARGIN_S,  # type: ignore[arg-type]
        )
        server = lifecycle.make_server(uv_config)
        watcher = asyncio.ensure_future(lifecycle.watch(server, engine, drain_timeout, outcome))
        logger.info("listening on http://%s:%d", host, port)
        try:
            await server.serve(sockets=[listener])
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    finally:
        engine.shutdown()
        listener.close()
    if outcome.engine_died:
        logger.error("exiting: the engine died (%s)", outcome.engine_died)
        return 1
    return 0


def _start_engine(config: EngineConfig, plugins: Any) -> Any:
    """The AsyncLLM, interruptible by Ctrl-C while it starts: asyncio's own SIGINT handler
    only cancels the task, which a start-up blocking the loop would notice when done."""
    from enginecore.engine.async_llm import AsyncLLM

    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return AsyncLLM(config=config, plugin_host=plugins)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_server(config: EngineConfig) -> int:
    """``enginecore serve``: blocks until the server stops; returns the exit status.

    On uvloop when it is installed (a dependency; uvicorn then also picks its httptools
    parser). Streaming 200 requests at once on the tiny model, the API server takes about
    13% less CPU time on uvloop than on asyncio's own loop: CPU it shares with the worker."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
