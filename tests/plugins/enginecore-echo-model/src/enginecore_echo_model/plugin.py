"""The plugin module named by the entry point: registers the EchoForCausalLM architecture."""

from __future__ import annotations

from typing import Any

import enginecore


@enginecore.hookimpl
def register_models(registry: Any) -> None:
    registry.add(
        "EchoForCausalLM",
        "enginecore_echo_model.model:EchoForCausalLM",
        summary="replies with the prompt's <|pad|>-marked span (tests)",
    )
