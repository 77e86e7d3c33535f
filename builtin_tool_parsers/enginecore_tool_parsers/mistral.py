"""Mistral's tool calls (``mistral``): text, then ``[TOOL_CALLS]`` and the calls.

Two spellings, as Mistral's tokenizers write them:

- up to tokenizer v7: ``[TOOL_CALLS][{"name": "get_weather", "arguments": {...}}, ...]``,
  a JSON list of calls;
- from tokenizer v11: ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``, once per call.

Mistral's chat templates accept only tool-call ids of nine letters and digits, so the
calls get ids of that shape.
"""

from __future__ import annotations

import secrets
import string

from enginecore.tool_parsers.base import ParsedText, PartialToolCall, ToolParser, held_back
from enginecore_tool_parsers.json_calls import (
    DECODER,
    json_calls,
    raw_json_prefix,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


def _named_call(segment: str, final: bool) -> PartialToolCall:
    """``name[ARGS]{json}``: one v11 call, maybe cut short."""
    name, sep, args = segment.partition(ARGS)
    if not sep:
        return PartialToolCall(invalid=True) if final else PartialToolCall()
    name = name.strip()
    if not name:
        return PartialToolCall(invalid=True)
    args = args.strip()
    raw, complete = raw_json_prefix(args)
    if final:
        if not complete or args[len(raw or "") :].strip():
            return PartialToolCall(invalid=True)
        if not isinstance(DECODER.decode(raw or ""), dict):
            return PartialToolCall(invalid=True)
    return PartialToolCall(name=name, arguments=raw)


class MistralToolParser(ToolParser):
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(TOOL_CALLS)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, TOOL_CALLS)
            return ParsedText(content=text[:keep])
        content, rest = text[:first], text[first + len(TOOL_CALLS) :]
        body = rest.lstrip()
        if body.startswith("["):  # a JSON list of calls
            try:
                items, end = DECODER.raw_decode(body)
            except ValueError:  # still being written, or cut short
                calls = json_calls(body[1:], final, separators=",")
                if final:
                    calls.append(PartialToolCall(invalid=True))
                return ParsedText(content=content, calls=calls)
            if not isinstance(items, list) or (final and body[end:].strip()):
                return ParsedText(content=content, calls=[PartialToolCall(invalid=True)])
            return ParsedText(content=content, calls=json_calls(body[1 : end - 1], True, ","))
        if not body and not final:
            return ParsedText(content=content)
        segments = body.split(TOOL_CALLS)
        calls = []
        for n, segment in enumerate(segments):
            last = n == len(segments) - 1
            if last and not final:
                segment = segment[: len(segment) - held_back(segment, TOOL_CALLS)]
            calls.append(_named_call(segment, final or not last))
        return ParsedText(content=content, calls=calls)
