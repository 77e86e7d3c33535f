"""``enginecore serve``: check the settings, start the engine, then serve HTTP.

The engine starts first, so a bad model or config fails before anything listens; the
HTTP app's modules (FastAPI, pydantic and the API's models: about 0.3 s on 2 cores) are
imported while the engine process starts, not before it is spawned. Once the engine is
ready the server logs what was resolved and serves with uvicorn on one event loop shared
with the :class:`~enginecore.AsyncLLM`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import socket
from typing import Any

from enginecore.config import EngineConfig
from enginecore.engine.client import alongside_engine_start
from enginecore.engine.preflight import reserve_port
from enginecore.errors import ConfigError
from enginecore.plugins import make_plugin_manager
from enginecore.server import lifecycle

logger = logging.getLogger("enginecore.server")

API_KEY_ENV = "ENGINECORE_API_KEY"
APP_MODULE = "enginecore.server.app"


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


def check_tool_config(config: Any, plugins: Any) -> None:
    """Fail at start-up on a tool-calling setting that cannot work."""
    server = config.server
    if not (server.enable_auto_tool_choice or server.tool_call_parser or server.reasoning_parser):
        return
    if plugins is None:
        plugins = make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
    if server.reasoning_parser:
        plugins.registry("reasoning_parser").get(server.reasoning_parser)  # lists the names
    registry = plugins.registry("tool_parser")
    if server.enable_auto_tool_choice and not server.tool_call_parser:
        raise ConfigError(
            "server.enable_auto_tool_choice needs server.tool_call_parser "
            f"(--tool-call-parser NAME; available: {', '.join(registry.names()) or 'none'})"
        )
    if server.tool_call_parser:
        registry.get(server.tool_call_parser)  # an unknown name lists the available ones


def _show_info_logs() -> None:
    # The CLI's root logger defaults to WARNING; the server's own lines (start-up, the
    # periodic stats line) are INFO and meant to be seen.
    for name in ("enginecore.server", "enginecore.metrics"):
        named = logging.getLogger(name)
        if named.level == logging.NOTSET:
            named.setLevel(logging.INFO)


async def serve(config: EngineConfig, listener: socket.socket | None = None) -> int:
    """Start the engine, then serve HTTP until SIGTERM/SIGINT (a drain, see
    :mod:`~enginecore.server.lifecycle`) or the engine's death; the engine stops with it.
    Returns the exit status: 0, or 1 when the engine died. ``listener``: the socket an
    API server of several inherited (:mod:`~enginecore.server.api_servers`)."""
    import uvicorn

    config = server_config(config)
    _show_info_logs()
    plugins = make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
    check_tool_config(config, plugins)  # before the engine starts: a bad name fails fast
    if listener is None:
        listener = reserve_port(config.server.host, config.server.port)
    try:
        with alongside_engine_start(lambda: importlib.import_module(APP_MODULE)):
            engine = _start_engine(config, plugins)
    except BaseException:
        listener.close()
        raise
    from enginecore.server.app import build_app, log_startup

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
        # Imported once the engine runs: it brings in the HTTP stack (see the module's doc).
        from enginecore.server.connection_limits import http_protocol

        bounded = http_protocol(config.server)
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=config.observability.log_requests,
            # uvicorn annotates whole seconds but waits with asyncio (fractions work).
            timeout_graceful_shutdown=drain_timeout + lifecycle.GRACE_MARGIN_S,  # type: ignore[arg-type]
            # Slow headers and bodies disconnected, open connections bounded.
            http=bounded if bounded is not None else "auto",
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
    if config.server.api_server_count > 1:
        from enginecore.server.api_servers import run_api_servers

        return run_api_servers(config)
    return _run_one_server(config)


def _run_one_server(config: EngineConfig) -> int:
    """``enginecore serve``: blocks until the server stops; returns the exit status.

    On uvloop when it is installed (a dependency; uvicorn then also picks its httptools
    parser). Streaming 200 requests at once on the tiny model, the API server takes about
    13% less CPU time on uvloop than on asyncio's own loop: CPU it shares with the worker."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
