"""``ToolParserContract``: what the server expects of a tool-call parser.

Subclass it, point it at your parser and give examples in your model's format::

    from enginecore.testing import ToolParserContract

    class TestMyParser(ToolParserContract):
        tool_parser = "my_format"          # a registered name, or the class
        examples = [
            # (model output, expected content, expected calls as (name, arguments))
            ('<call>{"name": "get_time", "arguments": {}}</call>', None, [("get_time", {})]),
        ]

The server builds a parser per request as ``factory(tokenizer)``, sets ``parser.tools``
to the request's tools, and calls ``parse(text, final)`` on the text generated so far,
after every token while streaming and once more with ``final=True``. The checks: the
whole reply gives the expected content and calls; the streamed deltas, fed in pieces of
any size, add up to exactly the whole reply; a call's name, once reported, never
changes and its arguments only grow; text with no call is all content; a reply cut short
anywhere never raises; and two parsers from one factory share no state.
"""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar

from enginecore.tool_parsers import ToolCallStream, ToolParser

Call = tuple[str, dict[str, Any]]


def stream_reply(parser: ToolParser, text: str, step: int) -> tuple[str, list[Call], list[str]]:
    """Feed ``text`` in pieces of ``step`` characters: the content, the calls rebuilt from
    the deltas as a client does, and their ids."""
    stream = ToolCallStream(parser)
    content = ""
    calls: list[list[Any]] = []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for n, piece in enumerate(pieces):
        delta = stream.feed(piece, final=n == len(pieces) - 1)
        content += delta.get("content", "")
        for item in delta.get("tool_calls", []):
            if item["index"] == len(calls):
                assert item.get("id") and item.get("type") == "function", (
                    "a call's first delta carries its id and type"
                )
                assert item["function"].get("name"), "a call's first delta carries its name"
                calls.append([item["id"], item["function"]["name"], ""])
            else:
                assert item["index"] < len(calls), "calls are streamed in order"
                assert "name" not in item["function"], "a call's name is sent once"
            calls[item["index"]][2] += item["function"].get("arguments", "")
    ids = [c[0] for c in calls]
    return content, [(c[1], _loads(c[2])) for c in calls], ids


def _loads(arguments: str) -> Any:
    """Streamed arguments as an object; the raw text when they do not add up to JSON."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


@functools.cache
def registered(kind: str, name: str) -> Any:
    """The factory registered under ``name`` (plugins are loaded once per test session)."""
    from enginecore.plugins import make_plugin_manager

    return make_plugin_manager(strict=False).registry(kind).get(name)


class ToolParserContract:
    """Subclass and set ``tool_parser`` (a registered name or the class) and ``examples``."""

    tool_parser: ClassVar[str | Any] = "hermes"
    #: (model output, expected content (None when empty), expected [(name, arguments)])
    examples: ClassVar[list[tuple[str, str | None, list[Call]]]] = [
        (
            'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "</tool_call>",
            "Checking.",
            [("get_weather", {"city": "Paris"})],
        )
    ]
    #: A reply with no tool call, in your format's terms.
    plain_text: ClassVar[str] = "The weather in Paris is mild today."
    #: The request's tools (OpenAI's shape), set on the parser as the server does.
    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": None}},
    ]

    def factory(self) -> Any:
        if not isinstance(self.tool_parser, str):
            return self.tool_parser
        return registered("tool_parser", self.tool_parser)

    def make_parser(self, tokenizer: Any = None) -> ToolParser:
        """Build it the way the server does; override to pass a real tokenizer."""
        parser: ToolParser = self.factory()(tokenizer)
        parser.tools = list(self.tools)
        return parser

    # --- the contract ------------------------------------------------------------------

    def test_is_a_tool_parser(self) -> None:
        parser = self.make_parser()
        assert isinstance(parser, ToolParser), "tool parsers subclass ToolParser"
        assert self.examples, "give at least one example in your format"

    def test_whole_replies_give_the_expected_calls(self) -> None:
        for text, content, calls in self.examples:
            result = self.make_parser().extract_tool_calls(text)
            assert result.content == content, f"content of {text!r}"
            got = [(c.name, json.loads(c.arguments)) for c in result.tool_calls]
            assert got == calls, f"calls of {text!r}"
            for call in result.tool_calls:
                assert isinstance(json.loads(call.arguments), dict), "arguments: a JSON object"
            assert len({c.id for c in result.tool_calls}) == len(calls), "ids are unique"

    def test_streamed_deltas_add_up_to_the_whole_reply(self) -> None:
        for text, _, _ in self.examples:
            whole = self.make_parser().extract_tool_calls(text)
            expected = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
            for step in (1, 2, 3, 7, max(1, len(text))):
                content, calls, ids = stream_reply(self.make_parser(), text, step)
                assert content == (whole.content or ""), f"streamed content, pieces of {step}"
                assert calls == expected, f"streamed calls of {text!r}, pieces of {step}"
                assert len(set(ids)) == len(ids)

    def test_names_never_change_and_arguments_only_grow(self) -> None:
        for text, _, _ in self.examples:
            final = self.make_parser().parse(text, final=True).calls
            parser = self.make_parser()
            for end in range(len(text) + 1):
                for i, call in enumerate(parser.parse(text[:end], final=False).calls):
                    if call.invalid or i >= len(final):
                        continue
                    if call.name is not None:
                        assert call.name == final[i].name, f"name of call {i} at {end} chars"
                    if call.arguments and call.name is not None:
                        assert (final[i].arguments or "").startswith(call.arguments), (
                            f"arguments of call {i} at {end} chars are not a prefix of the "
                            "final ones: the stream could not send them"
                        )

    def test_text_without_calls_is_content(self) -> None:
        result = self.make_parser().extract_tool_calls(self.plain_text)
        assert result.tool_calls == [] and result.content == self.plain_text
        content, calls, _ = stream_reply(self.make_parser(), self.plain_text, 3)
        assert calls == [] and content == self.plain_text

    def test_a_reply_cut_anywhere_never_raises(self) -> None:
        for text, _, _ in self.examples:
            for end in range(len(text)):
                result = self.make_parser().extract_tool_calls(text[:end])
                for call in result.tool_calls:
                    json.loads(call.arguments)  # a returned call has whole JSON arguments

    def test_parsers_share_no_state(self) -> None:
        text = self.examples[0][0]
        first, second = self.make_parser(), self.make_parser()
        first.parse(text, final=True)
        assert first is not second
        alone = self.make_parser().extract_tool_calls(text)
        after = second.extract_tool_calls(text)
        assert [(c.name, c.arguments) for c in after.tool_calls] == [
            (c.name, c.arguments) for c in alone.tool_calls
        ]
