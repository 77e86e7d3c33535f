"""Registers the built-in tool-call parsers through the same hook third-party plugins use."""

from __future__ import annotations

from enginecore.hookspecs import hookimpl
from enginecore.registry import Registry


@hookimpl(trylast=True)
def register_tool_parsers(registry: Registry) -> None:
    registry.add(
        "hermes",
        "enginecore_tool_parsers.hermes:HermesToolParser",
        summary='<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks',
    )
