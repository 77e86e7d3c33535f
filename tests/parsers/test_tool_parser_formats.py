"""The built-in tool-call parsers on their model families' real output formats.

Each text is written as the family's documentation and chat templates show the model
answering (Llama 3.1's JSON, Mistral's ``[TOOL_CALLS]`` in both tokenizer generations,
Llama 3.2/4's Python lists, Qwen3-Coder's XML). Whole results are checked against the
calls a vLLM user gets for that text, and streamed deltas, fed in pieces of every size,
must add up to the whole result.
"""

from __future__ import annotations

import json

import pytest

from enginecore.tool_parsers import ToolParser
from enginecore_tool_parsers.llama3_json import Llama3JsonToolParser
from enginecore_tool_parsers.mistral import MistralToolParser
from enginecore_tool_parsers.pythonic import PythonicToolParser
from enginecore_tool_parsers.qwen3_coder import Qwen3CoderToolParser
from tests.helpers.echo_model import stream_whole
from tests.helpers.tool_parser_cases import CASES, TOOLS


def _parser(cls: type[ToolParser]) -> ToolParser:
    parser = cls()
    parser.tools = TOOLS
    return parser


@pytest.mark.parametrize("case", list(CASES))
def test_whole_reply(case):
    cls, text, content, expected = CASES[case]
    result = _parser(cls).extract_tool_calls(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == expected
    assert len({c.id for c in result.tool_calls}) == len(expected)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_deltas_add_up_to_the_whole_reply(case, step):
    cls, text, _, _ = CASES[case]
    whole = _parser(cls).extract_tool_calls(text)
    content, calls, deltas = stream_whole(_parser(cls), text, step)
    assert content == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    if step == 1:
        named = [i for i, d in enumerate(deltas) if any("id" in t for t in d.get("tool_calls", []))]
        assert named[0] < len(deltas) - 1, "the first call is announced before the text ends"


# (parser, text, whether a stream sees it as plain text from the start). A call cut short
# (max_tokens) or malformed late has been announced in the stream before its end shows
# the fault, as in vLLM; the whole reply is then content.
NOT_CALLS = [
    (Llama3JsonToolParser, "The weather is fine.", True),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": ', False),
    (Llama3JsonToolParser, '{"answer": 42}', True),  # JSON, but not a call
    (MistralToolParser, "No tools needed.", True),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', False),
    (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]{bad}", False),
    (PythonicToolParser, "[1] is a citation, not a call.", True),
    (PythonicToolParser, "[get_weather(city='Par", False),
    (PythonicToolParser, "[get_weather('positional')]", False),
    (Qwen3CoderToolParser, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", False),
    (Qwen3CoderToolParser, "Plain <b>text</b> only.", True),
]


@pytest.mark.parametrize(("cls", "text", "plain"), NOT_CALLS)
def test_text_that_is_not_a_valid_call_is_content(cls, text, plain):
    result = _parser(cls).extract_tool_calls(text)
    assert result.tool_calls == [] and result.content == text
    content, calls, _ = stream_whole(_parser(cls), text, 3)
    if plain:
        assert calls == [] and content == text
    else:
        assert [c["name"] for c in calls] == ["get_weather"]


def test_mistral_ids_have_the_shape_its_templates_demand():
    result = MistralToolParser().extract_tool_calls("[TOOL_CALLS]get_time[ARGS]{}")
    (call,) = result.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    _, calls, _ = stream_whole(MistralToolParser(), "[TOOL_CALLS]get_time[ARGS]{}", 4)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


def test_content_is_streamed_before_the_calls_and_markers_are_held_back():
    text = "Sure.[TOOL_CALLS]get_time[ARGS]{}"
    _, _, deltas = stream_whole(MistralToolParser(), text, 1)
    contents = [d["content"] for d in deltas if "content" in d]
    assert "".join(contents) == "Sure." and len(contents) == 5
    assert not any("[" in c for c in contents)
