"""Reasoning in chat replies: a reasoning model's thinking as ``reasoning_content``.

With ``server.reasoning_parser`` set, each reply's text is split by the parser: the
thinking goes to ``reasoning_content`` (and to ``reasoning``, the field's newer name in
vLLM, which sends both), the rest is the reply's content, which tool-call parsing then
reads. Streamed, the thinking arrives as ``reasoning_content`` deltas before the content.
"""

from __future__ import annotations

from typing import Any

import msgspec

from enginecore.config import EngineProcessConfig
from enginecore.params import SamplingParams
from enginecore.reasoning_parsers import ReasoningParser, ReasoningStream
from enginecore.server.contained_parsers import build_contained_parser

#: Prompt tokens decoded for the parser's ``start``: enough for any marker and the blank
#: lines a template writes around it.
PROMPT_TAIL_TOKENS = 16


def new_reasoning_parser(
    registry: Any,
    name: str | None,
    tokenizer: Any,
    prompt_ids: list[int],
    timeout: float = EngineProcessConfig().frontend_plugin_timeout,
) -> ReasoningParser | None:
    """The request's parser, told how the prompt ends; None without a configured parser.
    Its ``parse``, ``start`` and ``extract_reasoning`` are bounded by ``timeout`` and
    named when they fail."""
    if not name:
        return None
    parser: ReasoningParser = build_contained_parser(
        "reasoning_parser", name, registry.get(name), tokenizer, timeout
    )
    tail = ""
    if tokenizer is not None and prompt_ids:
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    parser.start(tail)
    return parser


def constrain_after_reasoning(
    params: SamplingParams, parser: ReasoningParser | None
) -> SamplingParams:
    """Structured output applies to the answer only: its constraint waits for the end of
    the reasoning (unless the prompt already ended it, as with thinking disabled)."""
    spec = params.structured_output
    if parser is None or spec is None or parser.parse("", final=False).ended:
        return params
    end = parser.reasoning_end_token_ids()
    if not end:
        return params
    return params.clone(structured_output=msgspec.structs.replace(spec, reasoning_end=end))


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """The message or delta fields that carry reasoning text, under both names."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """The whole reply's ``(reasoning, content)``; without a parser, all content."""
    if parser is None:
        return None, text
    reasoning, content = parser.extract_reasoning(text)
    return reasoning, content or ""


class ChoiceReasoningStream:
    """One streamed choice's split: pass each text delta, get ``(reasoning, content)``."""

    def __init__(self, parser: ReasoningParser | None) -> None:
        self._stream = ReasoningStream(parser) if parser is not None else None

    @property
    def parses(self) -> bool:
        """Whether a parser splits the text (else it is all content)."""
        return self._stream is not None

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        if self._stream is None:
            return "", text
        return self._stream.feed(text, final=finished)
