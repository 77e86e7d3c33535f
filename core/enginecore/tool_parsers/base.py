"""The tool-parser contract and the generic streaming logic every parser shares.

A parser implements one method, :meth:`ToolParser.parse`: given the text generated so
far, return the plain content and the tool calls seen so far (a call's name once it is
complete, its arguments as the raw JSON text written so far). Whole responses and
streamed deltas are both derived from it, so the concatenated stream deltas always equal
the non-streamed result.
"""

from __future__ import annotations

import abc
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PartialToolCall:
    name: str | None = None  # None until the model has written the whole name
    arguments: str | None = None  # the raw JSON text of the arguments written so far
    invalid: bool = False  # a finished call that does not parse


@dataclass
class ParsedText:
    content: str  # text meant for the user (held back where it may begin a tool call)
    calls: list[PartialToolCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: new_tool_call_id())

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser(abc.ABC):
    """Base class of tool-call parsers. Factories registered with ``register_tool_parsers``
    are called as ``factory(tokenizer)`` once per request."""

    #: The format's markers are special tokens (Mistral's ``[TOOL_CALLS]``): the reply is
    #: detokenized with them (``skip_special_tokens`` off) so the parser can see them.
    keeps_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        #: The request's ``tools`` (OpenAI's dicts), set by the server before the first
        #: :meth:`parse`: formats that write arguments as text use their JSON schemas.
        self.tools: list[dict[str, Any]] = []

    def new_call_id(self) -> str:
        """A fresh tool-call id; override where the model family expects its own shape."""
        return new_tool_call_id()

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """Split ``text`` (everything generated so far) into content and tool calls.

        While ``final`` is False the text may stop anywhere: hold back content that could
        be the start of a tool-call marker, report a name only once it is complete, and
        report arguments only as a prefix of their final raw JSON text. With ``final``
        the text is complete; a call that does not parse is marked ``invalid``.
        """

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The whole response: tool calls, or (if any call is malformed) all text as content."""
        parsed = self.parse(text, final=True)
        if not parsed.calls or any(c.invalid or c.name is None for c in parsed.calls):
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls = [
            ToolCall(c.name, c.arguments or "{}", self.new_call_id())
            for c in parsed.calls
            if c.name is not None
        ]
        return ExtractedToolCalls(content=parsed.content or None, tool_calls=calls)


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


class ToolCallStream:
    """Turns growing text into OpenAI stream deltas: content, then per call its id and
    name first, then argument fragments."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent_calls: list[_SentCall] = []
        self.spoiled = False  # a call already announced proved malformed at the end

    @property
    def called(self) -> bool:
        """Whether the reply is tool calls (the stream then finishes with ``tool_calls``)."""
        return bool(self.sent_calls) and not self.spoiled

    def feed(self, delta_text: str, final: bool = False) -> dict[str, Any]:
        """The delta (``content`` and/or ``tool_calls``) that ``delta_text`` adds; may be {}."""
        self.text += delta_text
        parsed = self.parser.parse(self.text, final)
        delta: dict[str, Any] = {}
        spoiled = any(c.invalid or c.name is None for c in parsed.calls)
        if final and spoiled:
            # As a whole response: a reply with a malformed call is all content (the
            # content sent so far is the start of the text, in every format). Calls
            # already announced cannot be taken back: the rest of the text follows as
            # content and the reply is not a tool call, so nothing of it is lost.
            self.spoiled = bool(self.sent_calls)
            if len(self.text) > self.sent_content:
                delta["content"] = self.text[self.sent_content :]
                self.sent_content = len(self.text)
            return delta
        if len(parsed.content) > self.sent_content:
            delta["content"] = parsed.content[self.sent_content :]
            self.sent_content = len(parsed.content)
        tool_deltas = []
        for index, call in enumerate(parsed.calls):
            if call.invalid or call.name is None:
                break  # calls are streamed in order: wait for this one
            item: dict[str, Any] = {"index": index}
            if index == len(self.sent_calls):
                sent = _SentCall(self.parser.new_call_id())
                self.sent_calls.append(sent)
                item.update(id=sent.id, type="function", function={"name": call.name})
                item["function"]["arguments"] = ""
            sent = self.sent_calls[index]
            args = call.arguments or ""
            if len(args) > len(sent.arguments) and args.startswith(sent.arguments):
                item.setdefault("function", {})["arguments"] = args[len(sent.arguments) :]
                sent.arguments = args
            if len(item) > 1:
                tool_deltas.append(item)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta
