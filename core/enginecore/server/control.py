"""Engine control endpoints, each group opt-in: sleep / wake up (``enable_sleep_mode``),
pause / resume and the prefix-cache reset (``enable_dev_endpoints``), collective RPC.

``/collective_rpc`` runs a registered worker RPC on every worker, so it exists only when
``server.enable_collective_rpc_endpoint`` is on. It takes the *name* of one registered
through ``register_worker_rpcs`` and JSON arguments; nothing a client sends is ever
unpickled or executed as code.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from enginecore.engine.mp_client import UtilityError
from enginecore.errors import EngineDeadError
from enginecore.server.context import context
from enginecore.server.errors import APIError
from enginecore.server.protocol import CollectiveRPCRequest, PauseMode

sleep_router = APIRouter()
dev_router = APIRouter()
rpc_router = APIRouter()


@sleep_router.post("/sleep")
async def sleep(request: Request, level: int = Query(1, ge=0, le=2)) -> dict[str, Any]:
    await context(request).engine.sleep(level)
    return {"status": "sleeping", "level": level}


@sleep_router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    engine = context(request).engine
    await engine.wake_up()
    return {"status": "sleeping" if await engine.is_sleeping() else "awake"}


@sleep_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return {"is_sleeping": await context(request).engine.is_sleeping()}


@dev_router.post("/pause")
async def pause(request: Request, mode: PauseMode = "abort") -> dict[str, Any]:
    await context(request).engine.pause(mode)
    return {"status": "paused", "mode": mode}


@dev_router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await context(request).engine.resume()
    return {"status": "resumed"}


@dev_router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": await context(request).engine.is_paused()}


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    return {"reset": bool(await context(request).engine.reset_prefix_cache())}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


@rpc_router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRPCRequest, request: Request) -> dict[str, Any]:
    engine = context(request).engine
    # Only registered worker RPCs (register_worker_rpcs): never a Worker's own methods,
    # whose lifecycle calls (load_model, initialize_cache, shutdown) would break the engine.
    plugins = getattr(engine, "plugins", None)
    registered = sorted(plugins.registry("worker_rpc")) if plugins is not None else []
    if body.method not in registered:
        raise APIError(
            400,
            f"{body.method!r} is not a registered worker RPC; callable from outside: "
            f"{', '.join(registered) or 'none'}",
            param="method",
        )
    try:
        results = await engine.collective_rpc(
            body.method, body.timeout, tuple(body.args), body.kwargs
        )
    except UtilityError as exc:
        raise APIError(400, f"collective_rpc {body.method!r} failed: {exc}") from None
    except EngineDeadError as exc:  # a worker died during the call: not the caller's fault
        raise APIError(503, f"collective_rpc {body.method!r} failed: {exc}") from None
    return {"results": _jsonable(results)}
