"""The echo-model plugin (``tests/plugins/enginecore-echo-model``) and the tool-call texts it echoes."""

from __future__ import annotations

from pathlib import Path

from enginecore.tool_parsers import ToolCallStream, ToolParser

ECHO_PLUGIN = Path(__file__).parents[1] / "plugins" / "enginecore-echo-model"


PAD = "<|pad|>"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}


TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'


def stream_whole(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict], list]:
    """Feed ``text`` in pieces; rebuild content and calls from the deltas, as a client does."""
    stream = ToolCallStream(parser)
    content, calls, deltas = "", [], []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for n, piece in enumerate(pieces):
        delta = stream.feed(piece, final=n == len(pieces) - 1)
        deltas.append(delta)
        content += delta.get("content", "")
        for item in delta.get("tool_calls", []):
            if item["index"] == len(calls):
                assert {"id", "type", "function"} <= item.keys(), "the first delta names the call"
                calls.append({"id": item["id"], "name": item["function"]["name"], "arguments": ""})
            calls[item["index"]]["arguments"] += item["function"].get("arguments", "")
    return content, calls, deltas
