"""Qwen3-Coder's XML tool calls (``qwen3_coder``).

Each call is written as::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Text before the first call is content. Parameter values are text; each is converted by
the type its tool's JSON schema gives it (``integer``, ``number``, ``boolean``,
``object``/``array`` as JSON; a string otherwise, and also when the value does not convert).
While streaming, the arguments grow one finished parameter at a time.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from enginecore.tool_parsers.base import ParsedText, PartialToolCall, ToolParser, held_back

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"


def _convert(value: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if isinstance(kind, list):  # ["integer", "null"] and the like
        kind = next((k for k in kind if k != "null"), None)
    if value.lower() == "null" and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            if value.lower() in ("true", "false"):
                return value.lower() == "true"
            return value
        if kind in ("object", "array"):
            try:
                return json.loads(value)
            except ValueError:
                return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
    return value


class Qwen3CoderToolParser(ToolParser):
    def _schema(self, function: str, parameter: str) -> dict[str, Any] | None:
        for tool in self.tools:
            spec = tool.get("function") or {}
            if spec.get("name") == function:
                properties = (spec.get("parameters") or {}).get("properties") or {}
                found = properties.get(parameter)
                return found if isinstance(found, dict) else None
        return None

    def _call(self, body: str, final: bool) -> PartialToolCall:
        """One call's text after ``<tool_call>`` (up to ``</tool_call>`` when it is there)."""
        match = _FUNCTION.search(body)
        if match is None:
            return PartialToolCall(invalid=True) if final else PartialToolCall()
        name = match.group(1).strip()
        inner = body[match.end() :]
        closed = _FUNCTION_END in inner
        inner = inner.split(_FUNCTION_END, 1)[0]
        pieces = []
        end = 0
        for param in _PARAMETER.finditer(inner):
            key = param.group(1).strip()
            value = param.group(2)
            value = value.removeprefix("\n").removesuffix("\n")
            converted = _convert(value, self._schema(name, key))
            pieces.append(f"{json.dumps(key)}: {json.dumps(converted, ensure_ascii=False)}")
            end = param.end()
        unfinished = "<parameter=" in inner[end:]
        if final and (unfinished or (not closed and inner[end:].strip())):
            return PartialToolCall(invalid=True)
        arguments = "{" + ", ".join(pieces)
        if closed or final:
            arguments += "}"
        return PartialToolCall(name=name, arguments=arguments)

    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(START)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, START)
            return ParsedText(content=text[:keep])
        calls = []
        pos = first
        while (start := text.find(START, pos)) >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            if end < 0:
                calls.append(self._call(text[body_start:], final))
                break
            calls.append(self._call(text[body_start:end], True))
            pos = end + len(END)
        return ParsedText(content=text[:first], calls=calls)
