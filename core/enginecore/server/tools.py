"""Tool calling in ``/v1/chat/completions``: ``tools`` and ``tool_choice``, as vLLM does it.

- ``tools`` always reach the chat template (``apply_chat_template(tools=...)``).
- ``tool_choice: "none"``: the reply is plain content.
- ``"auto"`` (the default when tools are given): the reply is parsed by the configured
  tool-call parser; needs ``server.enable_auto_tool_choice`` and ``server.tool_call_parser``.
- ``"required"`` and ``{"type": "function", "function": {"name": ...}}``: the reply is
  constrained by structured output (a JSON schema built from the tools) and then read
  as the call(s); needs a registered structured-output backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from enginecore.config import EngineProcessConfig
from enginecore.params import StructuredOutputParams
from enginecore.registry import Registry
from enginecore.server.contained_parsers import build_contained_parser
from enginecore.server.errors import APIError
from enginecore.server.protocol import ChatCompletionRequest, NamedToolChoice
from enginecore.tool_parsers import ExtractedToolCalls, ToolCall, ToolCallStream, ToolParser
from enginecore.tool_parsers.base import new_tool_call_id

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template
    function_name: str | None = None  # mode "named"
    parser: ToolParser | None = None  # mode "auto"
    structured_output: StructuredOutputParams | None = None  # "required" / "named"
    parallel: bool = True

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_OBJECT


def plan_tools(
    body: ChatCompletionRequest,
    *,
    enable_auto_tool_choice: bool,
    parser_registry: Registry[Any] | None,
    parser_name: str | None,
    backend_registry: Registry[Any] | None,
    backend_name: str,
    tokenizer: Any,
    parser_timeout: float = EngineProcessConfig().frontend_plugin_timeout,
) -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400 on anything wrong) and decide what to do."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError(
            400, "tool_choice other than 'none' needs a non-empty 'tools' list", param="tools"
        )
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique, got {names}", param="tools")
    template_tools = [t.model_dump(exclude_unset=True) for t in tools] or None
    plan = ToolPlan(mode="none", tools=template_tools, parallel=body.parallel_tool_calls)
    if choice == "none":
        return plan
    if choice == "auto":
        if not enable_auto_tool_choice or not parser_name:
            raise APIError(
                400,
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser (config keys server.enable_auto_tool_choice and "
                'server.tool_call_parser); or send tool_choice "none", "required" or a '
                "named function",
                param="tool_choice",
            )
        assert parser_registry is not None
        plan.mode = "auto"
        plan.parser = build_contained_parser(
            "tool_parser", parser_name, parser_registry.get(parser_name), tokenizer, parser_timeout
        )
        plan.parser.tools = template_tools or []
        return plan
    tool = None
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in "
                f"tools ({names})",
                param="tool_choice",
            )
    if backend_registry is None or backend_name not in backend_registry.names():
        available = ", ".join(backend_registry.names()) if backend_registry else ""
        raise APIError(
            400,
            f"tool_choice {_describe(choice)} constrains the output with structured outputs, "
            f"but no structured-output backend named {backend_name!r} is registered "
            f"(available: {available or 'none'}; config key structured_output.backend)",
            param="tool_choice",
        )
    if tool is not None:
        plan.mode, plan.function_name = "named", tool.function.name
        plan.structured_output = StructuredOutputParams(json=_parameters(tool))
        return plan
    plan.mode = "required"
    plan.structured_output = StructuredOutputParams(json=_required_schema(tools, plan.parallel))
    return plan


def _describe(choice: Any) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming function {choice.function.name!r}"
    return repr(choice)


def _required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """A JSON array of ``{"name": ..., "parameters": {...}}``, each one of the tools.

    Each tool's ``$defs`` (and ``definitions``) move to the top of the combined schema, where
    its ``$ref`` pointers (``#/$defs/...``, relative to the document root) find them."""
    lifted: dict[str, dict[str, Any]] = {}
    variants = []
    for t in tools:
        parameters = dict(_parameters(t))
        for key in ("$defs", "definitions"):
            for name, definition in (parameters.pop(key, None) or {}).items():
                known = lifted.setdefault(key, {})
                if name in known and known[name] != definition:
                    raise APIError(
                        400,
                        f"tools: {key} {name!r} is defined differently by two tools; "
                        "tool_choice 'required' combines their schemas, so rename one",
                        param="tools",
                    )
                known[name] = definition
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(lifted)
    return schema


def extract(plan: ToolPlan, text: str) -> ExtractedToolCalls:
    """The reply's content and tool calls, whole (non-streaming)."""
    if plan.mode == "auto":
        assert plan.parser is not None
        result = plan.parser.extract_tool_calls(text)
    elif plan.mode == "named":
        result = _parse_named(plan.function_name or "", text)
    elif plan.mode == "required":
        result = _parse_required(text)
    else:
        return ExtractedToolCalls(text, [])
    if not plan.parallel:
        result.tool_calls = result.tool_calls[:1]
    return result


def _parse_named(name: str, text: str) -> ExtractedToolCalls:
    """The named function's call; none when the arguments were cut short (``length``).
    The content is an empty string, as vLLM sends it (clients take its ``len``)."""
    try:
        json.loads(text)
    except ValueError:
        return ExtractedToolCalls(text, [])
    return ExtractedToolCalls("", [ToolCall(name, text.strip())])


def _parse_required(text: str) -> ExtractedToolCalls:
    try:
        items = json.loads(text)
        calls = [
            ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
            for item in items
        ]
    except (ValueError, TypeError, KeyError):  # cut short (length), so not valid JSON
        return ExtractedToolCalls(text, [])
    if not calls:
        return ExtractedToolCalls(text, [])
    return ExtractedToolCalls("", calls)


def message(plan: ToolPlan, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for ``text``, and whether it calls tools."""
    result = extract(plan, text)
    msg: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.called:
        msg["tool_calls"] = [call.to_openai() for call in result.tool_calls]
    elif msg["content"] is None:
        msg["content"] = ""
    return msg, result.called


class ChoiceToolStream:
    """One choice's streamed deltas under a tool plan."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.called = False
        self._auto: ToolCallStream | None = None
        if plan.mode == "auto":
            assert plan.parser is not None  # an "auto" plan always has its parser
            self._auto = ToolCallStream(plan.parser)
        self._buffer = ""
        self._named_id: str | None = None

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        mode = self.plan.mode
        if mode == "none":
            return {"content": text} if text else {}
        if mode == "auto":
            assert self._auto is not None
            out = self._auto.feed(text, final=finished)
            if not self.plan.parallel and "tool_calls" in out:
                out["tool_calls"] = [d for d in out["tool_calls"] if d["index"] == 0]
                if not out["tool_calls"]:
                    del out["tool_calls"]
            self.called = self._auto.called
            return out
        if mode == "named":
            items = []
            if self._named_id is None:
                self._named_id = new_tool_call_id()
                self.called = True
                function = {"name": self.plan.function_name, "arguments": text}
                items.append(
                    {"index": 0, "id": self._named_id, "type": "function", "function": function}
                )
            elif text:
                items.append({"index": 0, "function": {"arguments": text}})
            return {"tool_calls": items} if items else {}
        # "required": a JSON array is read whole, once the reply is complete.
        self._buffer += text
        if not finished:
            return {}
        result = _parse_required(self._buffer)
        if not result.called:
            return {"content": self._buffer}
        self.called = True
        calls = result.tool_calls if self.plan.parallel else result.tool_calls[:1]
        return {"tool_calls": [{"index": i, **call.to_openai()} for i, call in enumerate(calls)]}
