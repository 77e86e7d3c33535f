"""What happens to a request field this server does not know (``server.unknown_request_fields``).

``reject`` (the default): pydantic's ``extra="forbid"`` makes it a 400 naming the field.
``warn``: the field is dropped before validation and logged once per field name, as vLLM
does; the request is served without it. The policy travels in a context variable that a
small ASGI middleware sets for each request, so the request models stay plain pydantic.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any, Literal

from pydantic import BaseModel

logger = logging.getLogger("enginecore.server")

Policy = Literal["reject", "warn"]

_policy: contextvars.ContextVar[Policy] = contextvars.ContextVar(
    "unknown_request_fields", default="reject"
)
_warned: set[str] = set()
_warned_lock = threading.Lock()


class UnknownFieldsPolicyMiddleware:
    """Sets the unknown-field policy for every request the app serves."""

    def __init__(self, app: Any, policy: Policy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        token = _policy.set(self.policy)
        try:
            await self.app(scope, receive, send)
        finally:
            _policy.reset(token)


def _known_names(model: type[BaseModel]) -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return names


def drop_unknown(model: type[BaseModel], data: Any) -> Any:
    """Under ``warn``, ``data`` without the keys ``model`` does not declare (each name
    logged once per process); under ``reject``, ``data`` unchanged (validation refuses)."""
    if _policy.get() != "warn" or not isinstance(data, dict):
        return data
    known = _known_names(model)
    unknown = [key for key in data if key not in known]
    if not unknown:
        return data
    with _warned_lock:
        fresh = [key for key in unknown if key not in _warned]
        _warned.update(fresh)
    if fresh:
        logger.warning(
            "ignoring request field(s) this server does not support: %s "
            "(server.unknown_request_fields is 'warn'; logged once per field name)",
            ", ".join(repr(key) for key in fresh),
        )
    return {key: value for key, value in data.items() if key in known}
