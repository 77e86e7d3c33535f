"""Reasoning parsers: split a reasoning model's thinking from its answer (whole or streamed).

A parser is registered by name with the ``register_reasoning_parsers`` hook (``qwen3``,
``deepseek_r1``, ``granite`` and ``mistral`` are built in) and chosen with
``server.reasoning_parser``. See :class:`ReasoningParser`.
"""

from enginecore.reasoning_parsers.base import (
    ParsedReasoning,
    ReasoningParser,
    ReasoningStream,
    ThinkTagReasoningParser,
)

__all__ = ["ParsedReasoning", "ReasoningParser", "ReasoningStream", "ThinkTagReasoningParser"]
