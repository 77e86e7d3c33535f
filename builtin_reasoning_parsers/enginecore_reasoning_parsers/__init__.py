"""Built-in reasoning parsers (``qwen3``, ``deepseek_r1``, ``granite``, ``mistral``),
registered through the public hook.

They implement :class:`enginecore.reasoning_parsers.ReasoningParser` like any plugin's
parser; ``server.reasoning_parser`` selects one.
"""
