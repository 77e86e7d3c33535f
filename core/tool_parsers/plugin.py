"""Registers the built-in tool-call parsers."""

from __future__ import annotations

from typing import Any

import enginecore


@enginecore.hookimpl(trylast=True)
def register_tool_parsers(registry: Any) -> None:
    registry.add(
        "hermes",
        "enginecore.tool_parsers.hermes:HermesToolParser",
        summary='<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks',
    )
