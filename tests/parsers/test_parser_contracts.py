"""The conformance kit for both parser kinds: every built-in parser passes its contract,
and the contracts catch broken parsers."""

from __future__ import annotations

import json

import pytest

from enginecore.reasoning_parsers import ParsedReasoning, ReasoningParser
from enginecore.testing import ReasoningParserContract, ToolParserContract
from enginecore.tool_parsers import ParsedText, PartialToolCall, ToolParser
from enginecore_tool_parsers.hermes import HermesToolParser
from tests.helpers.reasoning_parser_cases import CASES as REASONING_CASES
from tests.helpers.tool_parser_cases import CASES as TOOL_CASES
from tests.helpers.tool_parser_cases import TOOLS


def _tool_examples(name: str) -> list:
    return [
        (text, content, calls)
        for case, (cls, text, content, calls) in TOOL_CASES.items()
        if case.split()[0] == name
    ]


def _reasoning_examples(name: str) -> list:
    return [
        (prompt, text, reasoning, content)
        for case, (cls, prompt, text, reasoning, content) in REASONING_CASES.items()
        if case.split()[0] == name
    ]


class TestHermes(ToolParserContract):
    tool_parser = "hermes"


class TestLlama3Json(ToolParserContract):
    tool_parser = "llama3_json"
    examples = _tool_examples("llama3_json")
    tools = TOOLS


class TestMistralTools(ToolParserContract):
    tool_parser = "mistral"
    examples = _tool_examples("mistral")
    tools = TOOLS


class TestPythonic(ToolParserContract):
    tool_parser = "pythonic"
    examples = _tool_examples("pythonic")
    tools = TOOLS


class TestQwen3Coder(ToolParserContract):
    tool_parser = "qwen3_coder"
    examples = _tool_examples("qwen3_coder")
    tools = TOOLS


class TestQwen3(ReasoningParserContract):
    reasoning_parser = "qwen3"
    examples = _reasoning_examples("qwen3")


class TestDeepSeekR1(ReasoningParserContract):
    reasoning_parser = "deepseek_r1"
    examples = _reasoning_examples("deepseek_r1")


class TestGranite(ReasoningParserContract):
    reasoning_parser = "granite"
    examples = _reasoning_examples("granite")


class TestMistralReasoning(ReasoningParserContract):
    reasoning_parser = "mistral"
    examples = _reasoning_examples("mistral")


# --- the contracts catch broken parsers ----------------------------------------------------


class RenamingParser(HermesToolParser):
    """Reports a guessed name before the model has finished writing it."""

    def parse(self, text: str, final: bool) -> ParsedText:
        parsed = super().parse(text, final)
        if not final and "<tool_call>" in text and not parsed.calls[0].name:
            parsed.calls[0] = PartialToolCall(name="get")
        return parsed


class ReformattingParser(HermesToolParser):
    """Reformats the arguments once complete: the streamed prefix no longer matches."""

    def parse(self, text: str, final: bool) -> ParsedText:
        parsed = super().parse(text, final)
        for call in parsed.calls:
            if call.arguments and call.arguments.endswith("}"):
                call.arguments = json.dumps(json.loads(call.arguments), indent=1)
        return parsed


class BrokenToolContract(ToolParserContract):
    __test__ = False


def test_the_tool_contract_catches_a_name_that_changes():
    BrokenToolContract.tool_parser = RenamingParser
    with pytest.raises(AssertionError, match="name of call 0"):
        BrokenToolContract().test_names_never_change_and_arguments_only_grow()


def test_the_tool_contract_catches_arguments_a_stream_cannot_send():
    BrokenToolContract.tool_parser = ReformattingParser
    with pytest.raises(AssertionError, match="streamed calls"):
        BrokenToolContract().test_streamed_deltas_add_up_to_the_whole_reply()


class GreedyParser(ReasoningParser):
    """Calls everything reasoning until it sees the end marker, then takes it back."""

    end_markers = ("</think>",)

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        head, sep, tail = text.partition("</think>")
        if not sep:
            return ParsedReasoning(reasoning=text, content="")
        return ParsedReasoning(reasoning=head.removeprefix("<think>"), content=tail, ended=True)


class BrokenReasoningContract(ReasoningParserContract):
    __test__ = False
    reasoning_parser = GreedyParser


def test_the_reasoning_contract_catches_text_taken_back():
    with pytest.raises(AssertionError, match="takes back text already streamed"):
        BrokenReasoningContract().test_what_was_reported_never_shrinks()


def test_the_tool_contract_fails_a_parser_that_is_not_a_tool_parser():
    class NotAParser:
        def __init__(self, tokenizer):
            self.tools = []

    BrokenToolContract.tool_parser = NotAParser
    with pytest.raises(AssertionError, match="subclass ToolParser"):
        BrokenToolContract().test_is_a_tool_parser()
    assert issubclass(HermesToolParser, ToolParser)
