"""Llama 3.1/3.2's JSON tool calls (``llama3_json``).

With tools in its chat template, the model answers a call with nothing but JSON:
``{"name": "get_weather", "parameters": {"city": "Paris"}}``, optionally after the
``<|python_tag|>`` token, several calls separated by ``;``. A reply that does not open
with a call is plain content, as in vLLM.
"""

from __future__ import annotations

from enginecore.tool_parsers.base import ParsedText, ToolParser
from enginecore_tool_parsers.json_calls import json_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        elif not final and (PYTHON_TAG.startswith(body) or not body):
            return ParsedText(content="")  # may be the tag
        if not body.startswith("{"):
            if not final and not body:
                return ParsedText(content="")
            return ParsedText(content=text)
        return ParsedText(content="", calls=json_calls(body, final, separators=";"))
