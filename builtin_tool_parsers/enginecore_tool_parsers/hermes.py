"""The ``hermes`` tool-call format (Hermes 2 Pro, Qwen2.5, and many other chat models).

The model writes each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
text before the first call is the message content. A final call whose closing tag is
missing (generation stopped right after the JSON) is still accepted.
"""

from __future__ import annotations

import json
import re

from enginecore.tool_parsers.base import ParsedText, PartialToolCall, ToolParser

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _raw_arguments(body: str, start: int) -> tuple[str | None, bool]:
    """The raw JSON text of the arguments value beginning at ``start``; and whether it is
    complete. Only an object is streamed before it is complete."""
    rest = body[start:]
    try:
        _, end = _DECODER.raw_decode(rest)
        return rest[:end], True
    except ValueError:
        return (rest.rstrip(), False) if rest.startswith("{") else (None, False)


def _parse_call(body: str, complete: bool) -> PartialToolCall:
    body = body.strip()
    if complete:
        try:
            obj = json.loads(body)
        except ValueError:
            return PartialToolCall(invalid=True)
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str):
            return PartialToolCall(invalid=True)
        args = obj.get("arguments", obj.get("parameters", {}))
        key = _ARGS_KEY.search(body)
        raw = _raw_arguments(body, key.end())[0] if key else None
        if raw is None or json.loads(raw) != args:
            raw = json.dumps(args, ensure_ascii=False)
        return PartialToolCall(name=name, arguments=raw)
    match = _NAME.match(body)
    if match is None:
        return PartialToolCall()
    name = json.loads(f'"{match.group(1)}"')
    key = _ARGS_KEY.search(body, match.end())
    arguments = _raw_arguments(body, key.end())[0] if key else None
    return PartialToolCall(name=name, arguments=arguments)


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(START)
        if first < 0:
            keep = len(text) if final else len(text) - _held_back(text, START)
            return ParsedText(content=text[:keep])
        calls = []
        pos = first
        while (start := text.find(START, pos)) >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            if end < 0:
                body = text[body_start:]
                if not final:  # a closing tag may be arriving: do not read it as JSON
                    body = body[: len(body) - _held_back(body, END)]
                calls.append(_parse_call(body, complete=final))
                break
            calls.append(_parse_call(text[body_start:end], complete=True))
            pos = end + len(END)
        return ParsedText(content=text[:first], calls=calls)
