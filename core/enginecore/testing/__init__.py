"""The plugin conformance kit: contract test suites and pytest fixtures.

A plugin author subclasses a contract in their own tests and points it at their class::

    from enginecore.testing import SchedulingPolicyContract

    class TestMyPolicy(SchedulingPolicyContract):
        policy = "my-policy"

This module is also a pytest plugin, loaded only when asked for: ``pytest -p
enginecore.testing`` (or ``addopts = "-p enginecore.testing"`` in the project's pytest
settings, or ``pytest_plugins = ["enginecore.testing"]`` in its root ``conftest.py``). It
adds the fixtures in :mod:`enginecore.testing.fixtures` (``enginecore_model``,
``enginecore_llm``, ``enginecore_engine_process``, ``enginecore_server``). Importing it is cheap: the contracts load on first use, and the
fixtures import nothing heavy until a test asks for one.

The contracts look components up with strict mode off: another installed plugin that is
broken does not fail this plugin's tests (a component whose own plugin failed is still
unknown, and the error names that plugin's failure).
"""

from __future__ import annotations

import importlib
from typing import Any

from enginecore.testing.fixtures import (  # noqa: F401  (pytest collects these)
    enginecore_config_overrides,
    enginecore_engine_process,
    enginecore_llm,
    enginecore_model,
    enginecore_server,
    pytest_addoption,
)

_CONTRACTS = {
    "SchedulerContract": "enginecore.testing.scheduler_contract",
    "SchedulingPolicyContract": "enginecore.testing.scheduler_contract",
    "ExecutorContract": "enginecore.testing.executor_contract",
    "ModelRunnerContract": "enginecore.testing.model_runner_contract",
    "KVConnectorContract": "enginecore.testing.kv_connector_contract",
    "StatLoggerContract": "enginecore.testing.stat_logger_contract",
    "SpecDecodeProposerContract": "enginecore.testing.spec_decode_contract",
    "AttentionBackendContract": "enginecore.testing.attention_backend_contract",
    "LinearMethodContract": "enginecore.testing.linear_method_contract",
    "ToolParserContract": "enginecore.testing.tool_parser_contract",
    "ReasoningParserContract": "enginecore.testing.reasoning_parser_contract",
}


def __getattr__(name: str) -> Any:
    module = _CONTRACTS.get(name)
    if module is None:
        raise AttributeError(f"module 'enginecore.testing' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise ImportError(
            f"{name} is not part of this enginecore installation ({module} is missing); "
            "upgrade enginecore"
        ) from exc


__all__ = [
    "AttentionBackendContract",
    "LinearMethodContract",
    "ExecutorContract",
    "KVConnectorContract",
    "ModelRunnerContract",
    "ReasoningParserContract",
    "SchedulerContract",
    "SchedulingPolicyContract",
    "SpecDecodeProposerContract",
    "StatLoggerContract",
    "ToolParserContract",
]
