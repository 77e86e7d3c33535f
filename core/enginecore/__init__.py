"""enginecore: an LLM inference engine core built as a plugin framework.

Quick start for plugin authors::

    # pyproject.toml
    [project.entry-points.enginecore]
    myplugin = "mypkg.plugin"

    # mypkg/plugin.py
    import enginecore

    @enginecore.hookimpl
    def register_scheduling_policies(registry):
        registry.add("mine", "mypkg.policy:MyPolicy", summary="what it does")

Heavy modules (torch, the engine) are imported lazily, so ``import enginecore`` is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from enginecore.config import EngineConfig, make_config
from enginecore.errors import (
    ConfigError,
    DuplicateRegistrationError,
    EngineDeadError,
    InvalidRequestError,
    PluginLoadError,
    UnknownComponentError,
)
from enginecore.hookspecs import hookimpl
from enginecore.params import SamplingParams, StructuredOutputParams
from enginecore.plugins import make_plugin_manager
from enginecore.pooling import PoolingParams
from enginecore.version import PLUGIN_API_VERSION, __version__

if TYPE_CHECKING:
    from enginecore.engine.async_llm import AsyncLLM
    from enginecore.engine.beam_search import BeamSearchOutput, BeamSearchParams
    from enginecore.engine.llm import LLM
    from enginecore.engine.output import CompletionOutput, OutputKind, RequestOutput

_LAZY = {
    "LLM": "enginecore.engine.llm",
    "AsyncLLM": "enginecore.engine.async_llm",
    "RequestOutput": "enginecore.engine.output",
    "CompletionOutput": "enginecore.engine.output",
    "OutputKind": "enginecore.engine.output",
    "BeamSearchParams": "enginecore.engine.beam_search",
    "BeamSearchOutput": "enginecore.engine.beam_search",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'enginecore' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "PLUGIN_API_VERSION",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "OutputKind",
    "ConfigError",
    "DuplicateRegistrationError",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "LLM",
    "PluginLoadError",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputParams",
    "UnknownComponentError",
    "__version__",
    "hookimpl",
    "make_config",
    "make_plugin_manager",
]
