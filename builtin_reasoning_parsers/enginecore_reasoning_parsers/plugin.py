"""Registers the built-in reasoning parsers through the same hook third-party plugins use."""

from __future__ import annotations

from typing import Any

from enginecore.hookspecs import hookimpl
from enginecore.registry import Registry


@hookimpl(trylast=True)
def register_reasoning_parsers(registry: Registry[Any]) -> None:
    registry.add(
        "qwen3",
        "enginecore_reasoning_parsers.think_tags:Qwen3ReasoningParser",
        summary="<think>...</think>; no block means no reasoning",
    )
    registry.add(
        "deepseek_r1",
        "enginecore_reasoning_parsers.think_tags:DeepSeekR1ReasoningParser",
        summary="<think>...</think>; reasoning until </think>, opening tag optional",
    )
    registry.add(
        "granite",
        "enginecore_reasoning_parsers.granite:GraniteReasoningParser",
        summary="Here is my thought process: ... Here is my response: ...",
    )
    registry.add(
        "mistral",
        "enginecore_reasoning_parsers.think_tags:MistralReasoningParser",
        summary="[THINK]...[/THINK] (Magistral)",
    )
