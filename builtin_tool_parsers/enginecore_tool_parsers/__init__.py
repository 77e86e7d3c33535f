"""Built-in tool-call parsers (``hermes``), registered through the public hook.

They implement :class:`enginecore.tool_parsers.ToolParser` like any plugin's parser;
``server.tool_call_parser`` selects one.
"""
