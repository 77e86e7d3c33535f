"""``enginecore rpc METHOD``: call a worker RPC on a running server and print JSON.

It goes through the server's ``POST /collective_rpc``, which exists only when the server
was started with ``--enable-collective-rpc-endpoint``; a method is always a *name* (a
Worker method or one registered through ``register_worker_rpcs``), never code.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from enginecore.errors import EngineCoreError

DEFAULT_URL = "http://127.0.0.1:8000"
#: Seconds an RPC may run on each worker when ``--timeout`` is not given.
DEFAULT_TIMEOUT = 60.0
#: Seconds the client waits for the server's answer beyond the RPC's own limit.
ANSWER_GRACE = 15.0
API_KEY_ENV = "ENGINECORE_API_KEY"


class RPCCallError(EngineCoreError):
    """The server refused or failed the call; the message says why and what to do."""


def call_rpc(
    url: str,
    method: str,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    api_key: str | None = None,
    timeout: float | None = None,
) -> list[Any]:
    """POST ``/collective_rpc`` and return the per-rank results."""
    body: dict[str, Any] = {"method": method, "args": list(args or [])}
    if kwargs:
        body["kwargs"] = kwargs
    if timeout is not None:
        body["timeout"] = timeout
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    endpoint = url.rstrip("/") + "/collective_rpc"
    request = urllib.request.Request(
        endpoint, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    wait = (timeout if timeout is not None else DEFAULT_TIMEOUT) + ANSWER_GRACE
    try:
        with urllib.request.urlopen(request, timeout=wait) as response:
            results: list[Any] = json.loads(response.read())["results"]
            return results
    except TimeoutError:
        raise RPCCallError(
            f"{method}: the server at {url} did not answer within {wait:g} s (the RPC's "
            "limit plus the answer's grace): the server or its engine is stuck or "
            "overloaded. Check its /health and its log."
        ) from None
    except urllib.error.HTTPError as exc:
        detail = _error_message(exc)
        if exc.code == 404:
            raise RPCCallError(
                f"{endpoint} does not exist: start the server with "
                "--enable-collective-rpc-endpoint (config key "
                "server.enable_collective_rpc_endpoint) to allow worker RPCs"
            ) from None
        if exc.code == 401:
            raise RPCCallError(
                f"{endpoint} needs the server's API key: pass --api-key or set {API_KEY_ENV}"
            ) from None
        raise RPCCallError(f"{method} failed (HTTP {exc.code}): {detail}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise RPCCallError(
                f"{method}: the server at {url} did not answer within {wait:g} s: it is "
                "stuck or overloaded. Check its /health and its log."
            ) from None
        raise RPCCallError(
            f"cannot reach an enginecore server at {url}: {exc.reason}. "
            "Is 'enginecore serve' running there (see --url)?"
        ) from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    raw = exc.read().decode(errors="replace")
    try:
        message: str = json.loads(raw)["error"]["message"]
        return message
    except (ValueError, KeyError, TypeError):
        return raw.strip() or exc.reason


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RPCCallError(f"{what} must be JSON, got {text!r}: {exc}") from None


def cmd_rpc(args: argparse.Namespace) -> int:
    positional = [_json_arg(a, f"argument {a!r}") for a in args.args]
    kwargs = _json_arg(args.kwargs, "--kwargs") if args.kwargs else None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RPCCallError(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    results = call_rpc(
        args.url,
        args.method,
        positional,
        kwargs,
        api_key=args.api_key or os.environ.get(API_KEY_ENV),
        timeout=args.timeout,
    )
    print(json.dumps(results, indent=2))
    return 0


def add_rpc_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rpc",
        help="call a worker RPC (memory_snapshot, kv_cache_stats, ...) on a running server",
        description=(
            "Call METHOD on every worker of a running 'enginecore serve' and print the "
            "per-rank results as JSON. METHOD is the name of a worker RPC registered "
            "through register_worker_rpcs (a Worker's own methods cannot be called from "
            "outside). Built in: memory_snapshot, kv_cache_stats, model_summary, "
            "trace_next_steps N. Needs a server started with "
            "--enable-collective-rpc-endpoint."
        ),
    )
    p.add_argument("method", help="a registered worker RPC name ('enginecore plugins' lists them)")
    p.add_argument("args", nargs="*", help="positional arguments, each as JSON (e.g. 5)")
    p.add_argument("--kwargs", help="keyword arguments as a JSON object")
    p.add_argument("--url", default=DEFAULT_URL, help=f"server URL (default {DEFAULT_URL})")
    p.add_argument("--api-key", help=f"the server's API key (default: ${API_KEY_ENV})")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=(
            f"seconds the RPC may run on each worker (default {DEFAULT_TIMEOUT:g}); past "
            "it the call fails naming the RPC and the workers go on serving"
        ),
    )
    p.set_defaults(func=cmd_rpc)
