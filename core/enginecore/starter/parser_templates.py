"""The files ``enginecore plugin new`` writes for the two parser kinds: ``tool-parser``
and ``reasoning-parser`` (placeholders as in :mod:`enginecore.starter.templates`)."""

from __future__ import annotations

from enginecore.starter.templates import CONFIG_FILE_TEST, ENTRY_POINT_TEST, Kind

TOOL_PARSER = '''"""$cls: reads tool calls written as ``<call name="NAME">{JSON arguments}</call>``.

Text before the first call is the reply's content. Replace the format with your model's:
the server calls ``parse(text, final)`` with everything generated so far, after each
token while streaming and once with ``final=True``; the whole reply and the streamed
deltas are both derived from what it returns.
"""

from __future__ import annotations

import json
import re

from enginecore.tool_parsers import ParsedText, PartialToolCall, ToolParser

START, END = "<call", "</call>"
_HEAD = re.compile(r'<call name="([^"]+)">')


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class $cls(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(START)
        if first < 0:
            # While streaming, hold back a tail that may be the start of a call.
            keep = len(text) if final else len(text) - held_back(text, START)
            return ParsedText(content=text[:keep])
        calls = []
        pos = first
        while (start := text.find(START, pos)) >= 0:
            head = _HEAD.match(text, start)
            if head is None:  # the name is still being written (or never will be)
                calls.append(PartialToolCall(invalid=True) if final else PartialToolCall())
                break
            end = text.find(END, head.end())
            complete = end >= 0
            arguments = text[head.end() : end] if complete else text[head.end() :]
            if not complete and not final:
                arguments = arguments[: len(arguments) - held_back(arguments, END)]
            if complete or final:
                try:
                    valid = isinstance(json.loads(arguments), dict)
                except ValueError:
                    valid = False
                if not valid:
                    calls.append(PartialToolCall(invalid=True))
                    break
            # Arguments are reported as the raw text written so far: always a prefix of
            # the final text, so the stream can send them as they grow.
            calls.append(PartialToolCall(name=head.group(1), arguments=arguments.strip()))
            if not complete:
                break
            pos = end + len(END)
        return ParsedText(content=text[:first], calls=calls)
'''

TOOL_PARSER_TEST = (
    '''"""Tests of $cls: enginecore's tool-parser conformance kit on this format."""

from __future__ import annotations

import enginecore
from enginecore.testing import ToolParserContract

from $package import $cls

WEATHER = '<call name="get_weather">{"city": "Paris"}</call>'


class Test${cls}Contract(ToolParserContract):
    """Whole replies, streamed deltas in pieces of every size, replies cut short."""

    tool_parser = "$component"
    examples = [
        (f"Let me check. {WEATHER}", "Let me check. ", [("get_weather", {"city": "Paris"})]),
        (
            f'{WEATHER}<call name="get_time">{{}}</call>',
            None,
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ),
    ]


def test_a_malformed_call_leaves_the_reply_as_content():
    text = '<call name="get_weather">{"city": </call>'
    result = $cls().extract_tool_calls(text)
    assert result.tool_calls == [] and result.content == text
'''
    + ENTRY_POINT_TEST
    + CONFIG_FILE_TEST
)

REASONING_PARSER = '''"""$cls: a reasoning model's thinking, written ``<scratchpad>...</scratchpad>``.

``ThinkTagReasoningParser`` does the work: a block at the start of the output is the
reasoning, the rest is the answer; a prompt that ends inside an opened block (the chat
template wrote the opening marker) or after a closed one (thinking turned off) is
understood. Set your format's markers; override ``parse(text, final)`` for a format that
is not a block of markers.
"""

from __future__ import annotations

from enginecore.reasoning_parsers import ThinkTagReasoningParser


class $cls(ThinkTagReasoningParser):
    start_markers = ("<scratchpad>",)
    end_markers = ("</scratchpad>",)  # structured output applies after these
    # Output without an opening marker: the answer (False) or reasoning until the end
    # marker (True, for models that omit the opening marker).
    untagged_is_reasoning = False
'''

REASONING_PARSER_TEST = (
    '''"""Tests of $cls: enginecore's reasoning-parser conformance kit on this format."""

from __future__ import annotations

import enginecore
from enginecore.testing import ReasoningParserContract

from $package import $cls


class Test${cls}Contract(ReasoningParserContract):
    """Whole replies, streamed pieces of every size, replies cut short."""

    reasoning_parser = "$component"
    examples = [
        # (end of the rendered prompt, model output, reasoning, content)
        ("assistant:", "<scratchpad>Two and two.</scratchpad>Four.", "Two and two.", "Four."),
        ("assistant:<scratchpad>", "Two and two.</scratchpad>Four.", "Two and two.", "Four."),
        ("assistant:<scratchpad></scratchpad>", "Four.", None, "Four."),
        ("assistant:", "Four.", None, "Four."),
    ]


def test_a_reply_cut_short_while_thinking_is_all_reasoning():
    parser = $cls()
    parser.start("assistant:")
    assert parser.extract_reasoning("<scratchpad>Two and") == ("Two and", None)
'''
    + ENTRY_POINT_TEST
    + CONFIG_FILE_TEST
)

PARSER_KINDS: dict[str, Kind] = {
    "tool-parser": Kind(
        hook="register_tool_parsers",
        module="parser",
        class_suffix="ToolParser",
        summary="a tool-call parser for enginecore",
        config_key="tool_call_parser",
        select_toml='[server]\ntool_call_parser = "$component"\nenable_auto_tool_choice = true\n',
        component=TOOL_PARSER,
        test=TOOL_PARSER_TEST,
    ),
    "reasoning-parser": Kind(
        hook="register_reasoning_parsers",
        module="parser",
        class_suffix="ReasoningParser",
        summary="a reasoning parser for enginecore",
        config_key="reasoning_parser",
        select_toml='[server]\nreasoning_parser = "$component"\n',
        component=REASONING_PARSER,
        test=REASONING_PARSER_TEST,
    ),
}
