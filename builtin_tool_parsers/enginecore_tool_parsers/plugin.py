"""Registers the built-in tool-call parsers through the same hook third-party plugins use."""

from __future__ import annotations

from typing import Any

from enginecore.hookspecs import hookimpl
from enginecore.registry import Registry


@hookimpl(trylast=True)
def register_tool_parsers(registry: Registry[Any]) -> None:
    registry.add(
        "hermes",
        "enginecore_tool_parsers.hermes:HermesToolParser",
        summary='<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks',
    )
    registry.add(
        "llama3_json",
        "enginecore_tool_parsers.llama3_json:Llama3JsonToolParser",
        summary='{"name": ..., "parameters": ...} replies (Llama 3.1/3.2)',
    )
    registry.add(
        "mistral",
        "enginecore_tool_parsers.mistral:MistralToolParser",
        summary="[TOOL_CALLS] then a JSON list, or name[ARGS]{...} per call",
    )
    registry.add(
        "pythonic",
        "enginecore_tool_parsers.pythonic:PythonicToolParser",
        summary="[fn(key=value), ...] Python-list replies (Llama 3.2/4)",
    )
    registry.add(
        "qwen3_coder",
        "enginecore_tool_parsers.qwen3_coder:Qwen3CoderToolParser",
        summary="<tool_call><function=...><parameter=...> XML (Qwen3-Coder)",
    )
