"""The reasoning parsers on their model families' real output, whole and streamed, and the
``register_reasoning_parsers`` hook."""

from __future__ import annotations

import pytest

from enginecore.reasoning_parsers import (
    ParsedReasoning,
    ReasoningParser,
    ReasoningStream,
    ThinkTagReasoningParser,
)
from enginecore_reasoning_parsers.granite import GraniteReasoningParser
from enginecore_reasoning_parsers.think_tags import (
    Qwen3ReasoningParser,
)
from tests.helpers.plugin_host import bare_host, registering
from tests.helpers.reasoning_parser_cases import CASES, QWEN3_PROMPT


def _parser(cls: type[ReasoningParser], prompt: str) -> ReasoningParser:
    parser = cls()
    parser.start(prompt)
    return parser


@pytest.mark.parametrize("case", list(CASES))
def test_whole_reply(case):
    cls, prompt, text, reasoning, content = CASES[case]
    assert _parser(cls, prompt).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_pieces_add_up_to_the_whole_reply(case, step):
    cls, prompt, text, reasoning, content = CASES[case]
    stream = ReasoningStream(_parser(cls, prompt))
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    got_reasoning = got_content = ""
    for n, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=n == len(pieces) - 1)
        got_reasoning += r
        got_content += c
        assert "</think>" not in r + c or (content and "</think>" in content)
    assert (got_reasoning or None, got_content or None) == (reasoning, content)


def test_markers_are_never_streamed():
    stream = ReasoningStream(_parser(Qwen3ReasoningParser, QWEN3_PROMPT))
    text = "<think>\nabc\n</think>\n\nHi"
    out = [stream.feed(ch, final=i == len(text) - 1) for i, ch in enumerate(text)]
    assert all("<" not in r and "<" not in c for r, c in out)
    assert next(c for _, c in out if c) == "\n", "content starts right after the end marker"


def test_end_marker_token_ids():
    from enginecore.checkpoints import make_tokenizer

    tokenizer = make_tokenizer()
    (ids,) = Qwen3ReasoningParser(tokenizer).reasoning_end_token_ids()
    assert tokenizer.decode(ids) == "</think>"
    spellings = GraniteReasoningParser(tokenizer).reasoning_end_token_ids()
    assert [tokenizer.decode(ids) for ids in spellings] == [
        "Here is my response:",
        "Here's my response:",
    ]
    assert Qwen3ReasoningParser().reasoning_end_token_ids() is None


class AnswerParser(ThinkTagReasoningParser):
    """A third-party format: ``THOUGHT: ... ANSWER: ...``."""

    start_markers = ("THOUGHT:",)
    end_markers = ("ANSWER:",)


class WholeParser(ReasoningParser):
    def parse(self, text: str, final: bool) -> ParsedReasoning:
        return ParsedReasoning(reasoning=text, content="")


def test_hook_register_reasoning_parsers():
    host = bare_host(
        ("builtin", __import__("enginecore_reasoning_parsers.plugin", fromlist=["_"])),
        ("answers", registering("register_reasoning_parsers", "answer", AnswerParser)),
    )
    registry = host.registry("reasoning_parser")
    assert {n: registry.entry(n).plugin for n in registry} == {
        "qwen3": "builtin",
        "deepseek_r1": "builtin",
        "granite": "builtin",
        "mistral": "builtin",
        "answer": "answers",
    }
    parser = registry.get("answer")(None)
    assert parser.extract_reasoning("THOUGHT: hm ANSWER: 42") == (" hm ", " 42")
    assert WholeParser().extract_reasoning("all") == ("all", None)


def test_the_structured_output_gate_opens_after_any_end_sequence():
    from enginecore.structured_output.manager import ReasoningGate

    gate = ReasoningGate([[7, 8], [9]])
    assert gate.after_end([1, 2, 7]) is None
    assert gate.after_end([8, 5, 6]) == [5, 6], "a sequence split across steps is found"
    assert ReasoningGate([[7, 8], [9]]).after_end([1, 9]) == []
    assert ReasoningGate([[7, 8]]).after_end([8, 7]) is None


@pytest.mark.parametrize("skip", [True, False])
def test_the_eos_token_never_ends_the_text(skip):
    """With special tokens detokenized (a parser whose markers are special tokens), the
    EOS that finished the reply stays in its token ids but not in its text, as in vLLM."""
    from enginecore import SamplingParams
    from enginecore.checkpoints import make_tokenizer
    from enginecore.engine.output import OutputKind, RequestState
    from enginecore.protocol import EngineCoreOutput
    from enginecore.request import FinishReason

    tokenizer = make_tokenizer()
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=skip)
    state = RequestState("r", None, [1], params, tokenizer, output_kind=OutputKind.FINAL_ONLY)
    state.apply(EngineCoreOutput(request_id="r", new_token_ids=ids[:1]), 0.0)
    done = EngineCoreOutput(
        request_id="r",
        new_token_ids=[*ids[1:], tokenizer.eos_token_id],
        finish_reason=FinishReason.STOP,
    )
    state.apply(done, 0.0)
    assert state.text == "Hi there"
    assert state.token_ids == [*ids, tokenizer.eos_token_id]
