"""The reasoning-parser contract and the streaming logic every parser shares.

A reasoning model writes its thinking first, between markers (``<think>`` ... ``</think>``
for Qwen3 and DeepSeek-R1), then its answer. A parser implements one method,
:meth:`ReasoningParser.parse`: given the text generated so far, return the reasoning and
the content seen so far. Whole responses and streamed deltas are both derived from it, so
the concatenated stream deltas always equal the non-streamed result.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from enginecore.tool_parsers.base import held_back


@dataclass
class ParsedReasoning:
    reasoning: str  # the model's thinking, without its markers
    content: str  # the answer (held back where it may begin a marker)
    ended: bool = False  # the reasoning is over: what follows is the answer


class ReasoningParser(abc.ABC):
    """Base class of reasoning parsers. Factories registered with
    ``register_reasoning_parsers`` are called as ``factory(tokenizer)`` once per request.

    Before the first :meth:`parse`, the server calls :meth:`start` with the end of the
    rendered prompt, so a parser knows whether the chat template opened the think block
    itself (the output then has no opening marker) or closed it (thinking disabled).
    """

    #: The texts that end the reasoning (its spellings); their token ids tell the engine
    #: where structured output starts to apply (see :meth:`reasoning_end_token_ids`).
    end_markers: tuple[str, ...] = ()
    #: The markers are special tokens (Magistral's ``[THINK]``): the reply is detokenized
    #: with them (``skip_special_tokens`` off) so the parser can see them.
    keeps_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def start(self, prompt_tail: str) -> None:  # noqa: B027 - optional for subclasses
        """Called once with the last characters of the rendered prompt."""

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> ParsedReasoning:
        """Split ``text`` (everything generated so far) into reasoning and content.

        While ``final`` is False the text may stop anywhere: hold back text that could be
        the start of a marker. With ``final`` the text is complete.
        """

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """The whole response: ``(reasoning, content)``, each None when empty."""
        parsed = self.parse(text, final=True)
        return parsed.reasoning or None, parsed.content or None

    def reasoning_end_token_ids(self) -> list[list[int]] | None:
        """The token ids of each of :attr:`end_markers` (None without a tokenizer or
        marker). A marker that is one token in the vocabulary (``</think>`` in Qwen3's and
        DeepSeek-R1's) is found exactly; a text marker only where the model writes it as
        the tokenizer encodes it alone."""
        if not self.end_markers or self.tokenizer is None:
            return None
        encoded = [
            list(self.tokenizer.encode(marker, add_special_tokens=False))
            for marker in self.end_markers
        ]
        return [ids for ids in encoded if ids] or None


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between a start and an end marker, at the start of the output.

    - ``<think>R</think>C``: reasoning R, content C.
    - ``R</think>C`` where the chat template wrote the opening marker: the same.
    - the prompt ends with the end marker (thinking disabled by the template): all content.
    - no end marker after an opening one: reasoning cut short (``max_tokens``), all
      reasoning.
    - neither the output nor the prompt opens a block: :attr:`untagged_is_reasoning`
      decides whether the output is reasoning up to an end marker (DeepSeek-R1, which
      often omits the opening marker) or all content (Qwen3 without thinking).

    A format whose markers have several spellings lists them all in :attr:`start_markers`
    and :attr:`end_markers`.
    """

    start_markers: tuple[str, ...] = ("<think>",)
    end_markers: tuple[str, ...] = ("</think>",)
    untagged_is_reasoning: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.prompt_opened = False  # the prompt ends inside a think block
        self.prompt_closed = False  # the prompt ends right after a closed block

    def start(self, prompt_tail: str) -> None:
        tail = prompt_tail.rstrip()
        self.prompt_opened = tail.endswith(self.start_markers)
        self.prompt_closed = tail.endswith(self.end_markers)

    def _find_end(self, body: str) -> tuple[int, int]:
        """Where the first end marker starts and ends in ``body``; (-1, -1) without one."""
        found = [(i, i + len(m)) for m in self.end_markers if (i := body.find(m)) >= 0]
        return min(found) if found else (-1, -1)

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        if self.prompt_closed:
            return ParsedReasoning(reasoning="", content=text, ended=True)
        body = text.lstrip()
        opened = self.prompt_opened
        marker = next((m for m in self.start_markers if body.startswith(m)), None)
        if marker is not None:
            body, opened = body[len(marker) :], True
        elif not final and any(m.startswith(body) for m in self.start_markers):
            return ParsedReasoning(reasoning="", content="")  # may be an opening marker
        if not (opened or self.untagged_is_reasoning):
            return ParsedReasoning(reasoning="", content=text, ended=True)
        end, after = self._find_end(body)
        if end >= 0:
            return ParsedReasoning(reasoning=body[:end], content=body[after:], ended=True)
        # Still thinking, or cut short while thinking: all of it is reasoning.
        keep = len(body)
        if not final:
            keep -= max(held_back(body, m) for m in self.end_markers)
        return ParsedReasoning(reasoning=body[:keep], content="")


class ReasoningStream:
    """Turns growing text into stream pieces: reasoning text, then content text."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta_text: str, final: bool = False) -> tuple[str, str]:
        """The ``(reasoning, content)`` text that ``delta_text`` adds; either may be empty."""
        self.text += delta_text
        parsed = self.parser.parse(self.text, final)
        reasoning = parsed.reasoning[self.sent_reasoning :]
        content = parsed.content[self.sent_content :]
        self.sent_reasoning = max(self.sent_reasoning, len(parsed.reasoning))
        self.sent_content = max(self.sent_content, len(parsed.content))
        return reasoning, content
