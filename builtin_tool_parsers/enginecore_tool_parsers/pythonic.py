"""Python-list tool calls (``pythonic``): Llama 3.2 and Llama 4's format.

The model answers with a Python list of calls with keyword arguments,
``[get_weather(city="Paris", unit="celsius"), get_time()]``; Llama 4 wraps it in
``<|python_start|>`` ... ``<|python_end|>``. Argument values are Python literals (strings,
numbers, ``True``/``False``/``None``, lists and dicts), sent on as JSON. A reply that is
not such a list is plain content, as in vLLM. While streaming, each call's name is sent
once its ``(`` is written and its arguments once its ``)`` is.
"""

from __future__ import annotations

import ast
import json

from enginecore.tool_parsers.base import ParsedText, PartialToolCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_OPEN, _CLOSE = "([{", ")]}"


def _call(node: ast.expr) -> PartialToolCall:
    """A parsed ``name(key=literal, ...)`` as a finished call."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return PartialToolCall(invalid=True)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return PartialToolCall(invalid=True)
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return PartialToolCall(invalid=True)
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex)
        return PartialToolCall(invalid=True)
    return PartialToolCall(name=node.func.id, arguments=text)


def _top_level_calls(body: str) -> tuple[list[tuple[int, int]], int | None]:
    """Spans of the complete calls in the list ``body`` (which starts with ``[``), and
    where an unfinished call's ``(`` is (None if none)."""
    spans: list[tuple[int, int]] = []
    depth, quote, escaped, start, opened = 0, "", False, 1, None
    for i, ch in enumerate(body):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
            if depth == 2 and ch == "(":
                opened = i
        elif ch in _CLOSE:
            depth -= 1
            if depth == 1 and ch == ")":
                spans.append((start, i + 1))
                opened = None
        elif ch == "," and depth == 1:
            start = i + 1
    return spans, opened


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].strip()
            body = body.removesuffix(END).rstrip() if final or body.endswith(END) else body
        elif not final and START.startswith(body):
            return ParsedText(content="")  # may be the start token, or empty so far
        if not body.startswith("["):
            return ParsedText(content=text if body or final else "")
        if final:
            try:
                tree = ast.parse(body, mode="eval").body
            except SyntaxError:
                return ParsedText(content=text)
            if not isinstance(tree, ast.List) or not tree.elts:
                return ParsedText(content=text)
            return ParsedText(content="", calls=[_call(node) for node in tree.elts])
        spans, opened = _top_level_calls(body)
        calls = []
        for start, end in spans:
            try:
                node = ast.parse(body[start:end].strip(), mode="eval").body
            except SyntaxError:
                calls.append(PartialToolCall(invalid=True))
                break
            calls.append(_call(node))
        if opened is not None:
            name = body[spans[-1][1] if spans else 1 : opened].strip().lstrip(",").strip()
            calls.append(PartialToolCall(name=name if name.isidentifier() else None))
        return ParsedText(content="", calls=calls)
