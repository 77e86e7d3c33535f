"""The component kinds: the one table every other list of kinds is derived from.

A kind is a registry of named implementations, filled by one ``register_<kinds>`` hook
(``hookspecs.py``), optionally selected by a config key. The plugin host builds one
registry per row, ``enginecore plugins --check`` checks entries against ``base``, the
up-front config check and start-up errors name ``config_key``, and ``enginecore plugins``
describes the ``described`` kinds. A new kind is one row here and its hook spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from enginecore import interfaces
from enginecore.config import StructuredOutputConfig

if TYPE_CHECKING:
    from enginecore.config import EngineConfig


@dataclass(frozen=True)
class ComponentKind:
    """One kind of component."""

    name: str  # the registry's key: ``host.registry(name)``
    hook: str  # the hook spec whose implementations fill the registry
    #: The class every entry must subclass (checked by ``enginecore plugins --check``, and
    #: when registered for kinds with ``required_attributes``); None where entries are
    #: factories or modules of several shapes.
    base: type | None = None
    #: The config key that selects an implementation, named in errors and hints.
    config_key: str | None = None
    #: The names a config selects (checked against the registry before anything starts).
    selected: Callable[[EngineConfig], list[str]] | None = None
    #: ``enginecore plugins`` shows each entry's priority and what it supports.
    described: bool = False
    #: What the engine reads from every registered class, selected or not (``auto``
    #: selection compares all candidates): checked when an entry is registered.
    required_attributes: tuple[str, ...] = ()
    #: ``(positional arguments, shape)`` the engine calls an entry with, checked when it
    #: is registered: ``(1, "cls(config)")``.
    called_with: tuple[int, str] | None = None
    #: The expression of a plugin's code that reads the selected name, for the starter's
    #: README (the config key under ``config.`` when None).
    config_expr: str | None = None

    @property
    def label(self) -> str:
        """The kind in a sentence: ``scheduling policy``."""
        return self.name.replace("_", " ")


def _named(value: str | None, unselected: str | None = None) -> list[str]:
    """``[value]`` unless it is empty or the value that selects nothing (``auto``)."""
    return [value] if value and value != unselected else []


def _structured_output_backend(config: EngineConfig) -> list[str]:
    # The default backend loads only when a request asks for structured output.
    return _named(config.structured_output.backend, StructuredOutputConfig().backend)


COMPONENT_KINDS: tuple[ComponentKind, ...] = (
    ComponentKind(
        "scheduler",
        "register_schedulers",
        interfaces.Scheduler,
        "scheduler.name",
        lambda c: [c.scheduler.name],
    ),
    ComponentKind(
        "scheduling_policy",
        "register_scheduling_policies",
        interfaces.SchedulingPolicy,
        "scheduler.policy",
        lambda c: [c.scheduler.policy],
        called_with=(1, "cls(config)"),
    ),
    ComponentKind(
        "executor",
        "register_executors",
        interfaces.Executor,
        "parallel.executor",
        lambda c: _named(c.parallel.executor, "auto"),
    ),
    ComponentKind(
        "model_runner",
        "register_model_runners",
        interfaces.ModelRunner,
        "model.runner",
        lambda c: [c.model.runner],
    ),
    ComponentKind("model", "register_models", config_expr="config.model.path"),
    ComponentKind(
        "attention_backend",
        "register_attention_backends",
        interfaces.AttentionBackend,
        config_key="model.attention_backend",
        selected=lambda c: _named(c.model.attention_backend, "auto"),
        described=True,
        required_attributes=(
            "priority",
            "capabilities",
            "default_block_size",
            "unsupported_reason",
            "build_metadata",
            "forward",
        ),
        called_with=(1, "cls(spec)"),
    ),
    ComponentKind(
        "linear_method",
        "register_linear_methods",
        interfaces.LinearMethod,
        config_key="model.linear_method",
        selected=lambda c: _named(c.model.linear_method, "auto"),
        described=True,
        required_attributes=(
            "priority",
            "devices",
            "dtypes",
            "unsupported_reason",
            "create_weights",
            "apply",
        ),
        called_with=(1, "cls(config)"),
    ),
    ComponentKind(
        "kv_connector",
        "register_kv_connectors",
        config_key="kv_transfer.connector",
        selected=lambda c: _named(c.kv_transfer.connector),
    ),
    ComponentKind(
        "stat_logger",
        "register_stat_loggers",
        interfaces.StatLogger,
        "observability.stat_loggers",
        lambda c: list(c.observability.stat_loggers),
        config_expr="config.observability.stat_loggers[-1]",
    ),
    ComponentKind(
        "worker_rpc", "register_worker_rpcs", called_with=(1, "fn(worker, *args, **kwargs)")
    ),
    ComponentKind(
        "structured_output_backend",
        "register_structured_output_backends",
        config_key="structured_output.backend",
        selected=_structured_output_backend,
    ),
    ComponentKind(
        "spec_decode_proposer",
        "register_spec_decode_proposers",
        config_key="speculative.speculative_method",
        selected=lambda c: _named(c.speculative.speculative_method),
    ),
    ComponentKind(
        "tool_parser",
        "register_tool_parsers",
        config_key="server.tool_call_parser",
        selected=lambda c: _named(c.server.tool_call_parser),
        called_with=(1, "factory(tokenizer)"),
    ),
    ComponentKind(
        "reasoning_parser",
        "register_reasoning_parsers",
        config_key="server.reasoning_parser",
        selected=lambda c: _named(c.server.reasoning_parser),
    ),
)

#: Kind name -> its row.
KINDS: dict[str, ComponentKind] = {kind.name: kind for kind in COMPONENT_KINDS}
