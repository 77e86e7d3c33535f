"""Reading calls written as JSON objects ``{"name": ..., "arguments"|"parameters": {...}}``,
whole or cut anywhere (the shared part of the llama3_json and mistral formats)."""

from __future__ import annotations

import json
import re

from enginecore.tool_parsers.base import PartialToolCall

_NAME = re.compile(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
DECODER = json.JSONDecoder()


def raw_json_prefix(text: str) -> tuple[str | None, bool]:
    """The raw JSON value at the start of ``text`` and whether it is complete; an
    incomplete value is given (as written so far) only when it is an object."""
    try:
        _, end = DECODER.raw_decode(text)
        return text[:end], True
    except ValueError:
        return (text.rstrip(), False) if text.startswith("{") else (None, False)


def call_from_object(obj: object, raw: str) -> PartialToolCall:
    """A finished call from its decoded object (``raw``: the object's JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return PartialToolCall(invalid=True)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return PartialToolCall(invalid=True)
    if not isinstance(args, dict):
        return PartialToolCall(invalid=True)
    key = _ARGS_KEY.search(raw)
    text = raw_json_prefix(raw[key.end() :])[0] if key else None
    if text is None or json.loads(text) != args:
        text = json.dumps(args, ensure_ascii=False)
    return PartialToolCall(name=obj["name"], arguments=text)


def partial_call(body: str) -> PartialToolCall:
    """A call still being written: its name once complete, its arguments as written so far."""
    match = _NAME.match(body)
    if match is None:
        return PartialToolCall()
    name = json.loads(f'"{match.group(1)}"')
    key = _ARGS_KEY.search(body, match.end())
    arguments = raw_json_prefix(body[key.end() :])[0] if key else None
    return PartialToolCall(name=name, arguments=arguments)


def json_calls(body: str, final: bool, separators: str) -> list[PartialToolCall]:
    """The calls in ``body``: JSON objects one after another, between ``separators``
    characters (and whitespace). Text that is not a call makes the last call invalid."""
    calls: list[PartialToolCall] = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] in separators):
            pos += 1
        if pos >= len(body):
            return calls
        try:
            obj, end = DECODER.raw_decode(body, pos)
        except ValueError:
            if final or not body.startswith("{", pos):
                return [*calls, PartialToolCall(invalid=True)]
            return [*calls, partial_call(body[pos:])]
        calls.append(call_from_object(obj, body[pos:end]))
        pos = end
