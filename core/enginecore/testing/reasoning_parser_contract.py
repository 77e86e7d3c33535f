"""``ReasoningParserContract``: what the server expects of a reasoning parser.

Subclass it, point it at your parser and give examples in your model's format::

    from enginecore.testing import ReasoningParserContract

    class TestMyParser(ReasoningParserContract):
        reasoning_parser = "my_format"     # a registered name, or the class
        examples = [
            # (end of the prompt, model output, expected reasoning, expected content)
            ("assistant:", "<scratch>hm</scratch>Hi!", "hm", "Hi!"),
        ]

The server builds a parser per request as ``factory(tokenizer)``, calls
``start(prompt_tail)`` once, then ``parse(text, final)`` on the text generated so far,
after every token while streaming and once more with ``final=True``. The checks: whole
replies split as expected; streamed pieces of any size add up to the whole split; what
has been reported never shrinks (a stream cannot take text back); a reply cut anywhere
never raises; and one of ``end_markers``, which tell the engine where structured output
starts, appears in every example that has both reasoning and content.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from enginecore.reasoning_parsers import ReasoningParser, ReasoningStream


@functools.cache
def registered(kind: str, name: str) -> Any:
    """The factory registered under ``name`` (plugins are loaded once per test session)."""
    from enginecore.plugins import make_plugin_manager

    return make_plugin_manager(strict=False).registry(kind).get(name)


class ReasoningParserContract:
    """Subclass and set ``reasoning_parser`` (a registered name or the class) and
    ``examples``."""

    reasoning_parser: ClassVar[str | Any] = "qwen3"
    #: (prompt tail, model output, expected reasoning (None if none), expected content)
    examples: ClassVar[list[tuple[str, str, str | None, str | None]]] = [
        ("<|im_start|>assistant\n", "<think>A greeting.</think>Hello!", "A greeting.", "Hello!"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello!", None, "Hello!"),
    ]

    def factory(self) -> Any:
        if not isinstance(self.reasoning_parser, str):
            return self.reasoning_parser
        return registered("reasoning_parser", self.reasoning_parser)

    def make_parser(self, prompt_tail: str, tokenizer: Any = None) -> ReasoningParser:
        """Build and start it the way the server does; override to pass a tokenizer."""
        parser: ReasoningParser = self.factory()(tokenizer)
        parser.start(prompt_tail)
        return parser

    # --- the contract ------------------------------------------------------------------

    def test_is_a_reasoning_parser(self) -> None:
        parser = self.make_parser("")
        assert isinstance(parser, ReasoningParser), "reasoning parsers subclass ReasoningParser"
        assert all(isinstance(m, str) and m for m in parser.end_markers)
        assert self.examples, "give at least one example in your format"

    def test_whole_replies_split_as_expected(self) -> None:
        for prompt, text, reasoning, content in self.examples:
            got = self.make_parser(prompt).extract_reasoning(text)
            assert got == (reasoning, content), f"split of {text!r} after {prompt!r}"

    def test_streamed_pieces_add_up_to_the_whole_reply(self) -> None:
        for prompt, text, reasoning, content in self.examples:
            for step in (1, 2, 3, 7, max(1, len(text))):
                stream = ReasoningStream(self.make_parser(prompt))
                pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
                got_reasoning = got_content = ""
                for n, piece in enumerate(pieces):
                    r, c = stream.feed(piece, final=n == len(pieces) - 1)
                    got_reasoning, got_content = got_reasoning + r, got_content + c
                assert (got_reasoning or None, got_content or None) == (reasoning, content), (
                    f"streamed split of {text!r} in pieces of {step}"
                )

    def test_what_was_reported_never_shrinks(self) -> None:
        for prompt, text, _, _ in self.examples:
            parser = self.make_parser(prompt)
            last_reasoning = last_content = ""
            for end in range(len(text) + 1):
                parsed = parser.parse(text[:end], final=end == len(text))
                assert parsed.reasoning.startswith(last_reasoning), (
                    f"reasoning at {end} chars takes back text already streamed"
                )
                assert parsed.content.startswith(last_content), (
                    f"content at {end} chars takes back text already streamed"
                )
                last_reasoning, last_content = parsed.reasoning, parsed.content

    def test_a_reply_cut_anywhere_never_raises(self) -> None:
        for prompt, text, _, _ in self.examples:
            for end in range(len(text)):
                reasoning, content = self.make_parser(prompt).extract_reasoning(text[:end])
                assert reasoning is None or isinstance(reasoning, str)
                assert content is None or isinstance(content, str)

    def test_the_end_marker_ends_the_reasoning(self) -> None:
        for prompt, text, reasoning, content in self.examples:
            parser = self.make_parser(prompt)
            if reasoning and content and parser.end_markers:
                assert any(marker in text for marker in parser.end_markers), (
                    f"{text!r} ends its reasoning without any of end_markers "
                    f"{parser.end_markers!r}: structured output would never start"
                )
