"""Tool-call parsers: turn a model's text into OpenAI ``tool_calls`` (whole or streamed).

A parser is registered by name with the ``register_tool_parsers`` hook (``hermes`` is
built in) and chosen with ``server.tool_call_parser``. See :class:`ToolParser`.
"""

from enginecore.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedText,
    PartialToolCall,
    ToolCall,
    ToolCallStream,
    ToolParser,
)

__all__ = [
    "ExtractedToolCalls",
    "ParsedText",
    "PartialToolCall",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
]
