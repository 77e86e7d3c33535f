"""Built-in tool-call parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``,
``qwen3_coder``), registered through the public hook.

They implement :class:`enginecore.tool_parsers.ToolParser` like any plugin's parser;
``server.tool_call_parser`` selects one.
"""
