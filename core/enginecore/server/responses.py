"""``POST /v1/responses`` (OpenAI's Responses API, text only, as vLLM serves it) and
``GET /v1/responses/{id}``.

The input (a string, or message items with ``input_text`` / ``output_text`` parts) and the
``instructions`` (a system message) go through the chat template like a chat request.
With ``store`` (the default) a response is kept in memory, at most
:data:`MAX_STORED_RESPONSES` of them and ``server.max_stored_response_bytes`` of JSON in
all, oldest dropped first, so that a later request can continue it with
``previous_response_id``. With ``server.reasoning_parser`` set, a reasoning model's
thinking comes back as a ``reasoning`` output item before the message (streamed as
``response.reasoning_text.delta`` events). Tools, images and the other parts
of the API this server does not do are a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from enginecore.engine.output import OutputKind, RequestOutput
from enginecore.errors import EngineCoreError
from enginecore.params import SamplingParams
from enginecore.server.client_quota import client_fields
from enginecore.server.contained_parsers import run_parsing
from enginecore.server.context import ServerContext, context
from enginecore.server.errors import APIError, error_body, status_of
from enginecore.server.limits import check_capacity, check_prompt_tokens
from enginecore.server.protocol import ResponsesRequest
from enginecore.server.reasoning import (
    ChoiceReasoningStream,
    new_reasoning_parser,
    split_reasoning,
)
from enginecore.server.sampling import check_max_tokens, check_model
from enginecore.server.streaming import (
    SSE_HEADERS,
    ClientDisconnected,
    aborting_when_left,
    unless_disconnected,
)

router = APIRouter()

#: Most responses kept for ``previous_response_id`` (oldest dropped first).
MAX_STORED_RESPONSES = 1024

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseStore:
    """Stored responses and the conversation each one ends, bounded in number and in
    bytes (least recent out)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = 1 << 26) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, str]], int]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, str]]) -> None:
        size = len(json.dumps([response, conversation], separators=(",", ":")))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (a later lookup gets 404)
        with self._lock:
            old = self._items.pop(response["id"], None)
            if old is not None:
                self.num_bytes -= old[2]
            self._items[response["id"]] = (response, conversation, size)
            self.num_bytes += size
            while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
                _, _, dropped = self._items.popitem(last=False)[1]
                self.num_bytes -= dropped

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
        if item is None:
            raise APIError(
                404,
                f"no stored response with id {response_id!r} (responses are kept only with "
                f"store: true, the most recent {self.capacity} within "
                f"{self.max_bytes} bytes)",
                param="previous_response_id",
            )
        return item[0], item[1]


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if not hasattr(state, "response_store"):
        limits = state.ctx.limits
        state.response_store = ResponseStore(max_bytes=limits.max_stored_response_bytes)
    store: ResponseStore = state.response_store
    return store


def _check_unsupported(body: ResponsesRequest, reasoning_parser: str | None) -> None:
    if body.reasoning is not None and not reasoning_parser:
        raise APIError(
            400,
            "reasoning needs the server to run with a reasoning parser (--reasoning-parser "
            "NAME, config key server.reasoning_parser)",
            param="reasoning",
        )
    given = {
        "tools": bool(body.tools),
        "include": bool(body.include),
        "background": bool(body.background),
        "top_logprobs": body.top_logprobs is not None,
    }
    for name, set_ in given.items():
        if set_:
            raise APIError(
                400,
                f"{name} is not supported on /v1/responses by this server (text only)",
                param=name,
            )
    fmt = (body.text or {}).get("format")
    if body.text is not None and set(body.text) - {"format"}:
        extra = ", ".join(sorted(set(body.text) - {"format"}))
        raise APIError(400, f"text.{extra} is not supported", param="text")
    if fmt is not None and fmt.get("type") != "text":
        raise APIError(
            400,
            f"text.format of type {fmt.get('type')!r} is not supported on /v1/responses "
            "(only 'text'; use /v1/chat/completions with response_format)",
            param="text",
        )


def _item_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content must be a string or a list", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"input[{index}].content[{j}]: parts of type {kind!r} are not supported "
                "(this server serves text: input_text or output_text with a string text)",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """The request's input as chat messages (without its instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise APIError(400, "input must not be empty", param="input")
    messages = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # earlier thinking, sent back: chat templates drop it from the prompt
        if kind != "message":
            raise APIError(
                400,
                f"input[{i}]: items of type {kind!r} are not supported (this server takes "
                "message items: text only, no tools or reasoning)",
                param="input",
            )
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(
                400,
                f"input[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                param="input",
            )
        messages.append({"role": role, "content": _item_text(i, item.get("content"))})
    return messages


def _sampling_params(ctx: ServerContext, body: ResponsesRequest) -> SamplingParams:
    defaults = ctx.sampling_defaults
    max_tokens = body.max_output_tokens
    limit = ctx.limits.max_tokens_limit
    if limit is not None:
        if max_tokens is not None and max_tokens > limit:
            raise APIError(
                400,
                f"max_output_tokens must be at most {limit}, got {max_tokens}",
                param="max_output_tokens",
            )
        max_tokens = limit if max_tokens is None else max_tokens
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    optional = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name, None)
        value = defaults.get(name) if value is None else value
        if value is not None:
            optional[name] = value
    extra = dict(body.metadata or {})
    if body.user is not None:
        extra["user"] = body.user
    extra.update(client_fields())  # the client's key and rank (not the body's)
    try:
        return SamplingParams(max_tokens=max_tokens, extra=extra or None, **optional)
    except EngineCoreError as exc:
        raise APIError(400, str(exc)) from None


def _usage(
    input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": content,
        "encrypted_content": None,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if text or status == "completed" else [],
    }


def _response(
    ctx: ServerContext,
    body: ResponsesRequest,
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    incomplete = None
    if finish_reason == "length":
        status = "incomplete"
        incomplete = {"reason": "max_output_tokens"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": ctx.model_name,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": [],
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
        "metadata": body.metadata or {},
    }


@router.post("/v1/responses", dependencies=[Depends(check_capacity)])
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx = context(request)
    engine = ctx.engine
    check_model(body.model, ctx.model_name, ctx.model_path, ctx.model_aliases)
    _check_unsupported(body, ctx.limits.reasoning_parser)
    history: list[dict[str, str]] = []
    store = _store(request)
    if body.previous_response_id is not None:
        _, history = store.get(body.previous_response_id)
    conversation = [*history, *input_messages(body)]
    # Instructions apply to this request only (OpenAI: not carried to the next one).
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    params = _sampling_params(ctx, body)
    prompt_ids = await asyncio.to_thread(engine.chat_prompt, [*system, *conversation])
    check_prompt_tokens([len(prompt_ids)], ctx.limits)
    if 0 < len(prompt_ids) < engine.max_model_len:
        check_max_tokens(
            body.max_output_tokens, len(prompt_ids), engine.max_model_len, "max_output_tokens"
        )
    reasoner = await run_parsing(
        bool(ctx.limits.reasoning_parser),
        new_reasoning_parser,
        engine.plugins.registry("reasoning_parser"),
        ctx.limits.reasoning_parser,
        engine.tokenizer,
        prompt_ids,
        ctx.config.engine.frontend_plugin_timeout,
    )
    if reasoner is not None and reasoner.keeps_special_tokens:
        params = params.clone(skip_special_tokens=False)  # the markers are special tokens
    response_id = f"resp_{uuid.uuid4().hex}"
    item_id = f"msg_{uuid.uuid4().hex}"
    reasoning_id = f"rs_{uuid.uuid4().hex}"
    created = int(time.time())
    collector = engine.add_request(
        response_id,
        {"prompt_token_ids": prompt_ids},
        params,
        output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY,
    )

    def finish(text: str, output: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]:
        reason = output.outputs[0].finish_reason
        reasoning, text = split_reasoning(reasoner, text)
        items = [_message_item(item_id, text, "completed")]
        if reasoning:
            items.insert(0, _reasoning_item(reasoning_id, reasoning, "completed"))
            tokens = engine.tokenizer.encode(reasoning, add_special_tokens=False)
            usage["output_tokens_details"]["reasoning_tokens"] = len(tokens)
        final = _response(ctx, body, response_id, created, "completed", items, usage, reason)
        if body.store:
            store.put(final, [*conversation, {"role": "assistant", "content": text}])
        return final

    if body.stream:
        stream = _stream(
            ctx,
            body,
            response_id,
            (reasoning_id, item_id),
            created,
            engine.stream(collector),
            finish,
            ChoiceReasoningStream(reasoner),
        )
        return StreamingResponse(
            aborting_when_left(stream, engine, collector.request_id),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def final() -> RequestOutput:
        last: RequestOutput | None = None
        async for output in engine.stream(collector):
            last = output
        assert last is not None
        return last

    try:
        output = await unless_disconnected(request, final())
    except ClientDisconnected:
        return Response(status_code=499)
    usage = _usage(
        len(output.prompt_token_ids), len(output.outputs[0].token_ids), output.num_cached_tokens
    )
    reply = await run_parsing(reasoner is not None, finish, output.outputs[0].text, output, usage)
    return JSONResponse(reply)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    response, _ = _store(request).get(response_id)
    return JSONResponse(response)


def _event(kind: str, sequence: int, **data: Any) -> str:
    payload = {"type": kind, "sequence_number": sequence, **data}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(
    ctx: ServerContext,
    body: ResponsesRequest,
    response_id: str,
    item_ids: tuple[str, str],
    created: int,
    outputs: AsyncIterator[RequestOutput],
    finish: Callable[[str, RequestOutput, dict[str, Any]], dict[str, Any]],
    reasoning: ChoiceReasoningStream,
) -> AsyncIterator[str]:
    """OpenAI's event sequence: created, in_progress; for a reasoning model the reasoning
    item (added, its text part, reasoning text deltas, done); the message item and its text
    part opened, text deltas, the text, part and item done; completed."""
    seq = itertools.count()
    reasoning_id, item_id = item_ids
    started = _response(ctx, body, response_id, created, "in_progress", [], None)
    yield _event("response.created", next(seq), response=started)
    yield _event("response.in_progress", next(seq), response=started)
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    raw: list[str] = []  # the model's text, markers and all
    thought: list[str] = []
    text: list[str] = []
    opened: list[str] = []  # the kinds of item opened so far, in output order
    where: dict[str, Any] = {}

    def close_reasoning() -> list[str]:
        full = "".join(thought)
        at = {"item_id": reasoning_id, "output_index": 0, "content_index": 0}
        return [
            _event("response.reasoning_text.done", next(seq), text=full, **at),
            _event(
                "response.content_part.done",
                next(seq),
                part={"type": "reasoning_text", "text": full},
                **at,
            ),
            _event(
                "response.output_item.done",
                next(seq),
                output_index=0,
                item=_reasoning_item(reasoning_id, full, "completed"),
            ),
        ]

    def open_message() -> list[str]:
        if "reasoning" in opened:
            events = close_reasoning()
        else:
            events = []
        index = len(opened)
        opened.append("message")
        where.update(item_id=item_id, output_index=index, content_index=0)
        events.append(
            _event(
                "response.output_item.added",
                next(seq),
                output_index=index,
                item=_message_item(item_id, "", "in_progress"),
            )
        )
        events.append(_event("response.content_part.added", next(seq), part=part, **where))
        return events

    prompt_tokens = completion_tokens = cached = 0
    last = None
    try:
        async for output in outputs:
            last = output
            prompt_tokens = len(output.prompt_token_ids)
            cached = output.num_cached_tokens
            completion = output.outputs[0]
            completion_tokens += len(completion.token_ids)
            finished = completion.finish_reason is not None
            raw.append(completion.text)
            piece_of_thought, piece = await run_parsing(
                reasoning.parses, reasoning.feed, completion.text, finished
            )
            if piece_of_thought and not opened:
                opened.append("reasoning")
                at = {"item_id": reasoning_id, "output_index": 0}
                yield _event(
                    "response.output_item.added",
                    next(seq),
                    output_index=0,
                    item=_reasoning_item(reasoning_id, "", "in_progress"),
                )
                yield _event(
                    "response.content_part.added",
                    next(seq),
                    part={"type": "reasoning_text", "text": ""},
                    content_index=0,
                    **at,
                )
            if piece_of_thought and opened[-1] == "reasoning":
                thought.append(piece_of_thought)
                yield _event(
                    "response.reasoning_text.delta",
                    next(seq),
                    delta=piece_of_thought,
                    item_id=reasoning_id,
                    output_index=0,
                    content_index=0,
                )
            if piece:
                if "message" not in opened:
                    for event in open_message():
                        yield event
                text.append(piece)
                yield _event(
                    "response.output_text.delta", next(seq), delta=piece, logprobs=[], **where
                )
        assert last is not None
        usage = _usage(prompt_tokens, completion_tokens, cached)
        # The whole reply's split runs the parser once more: a failure there is an error
        # event too, sent before anything says the text is done.
        completed = await run_parsing(reasoning.parses, finish, "".join(raw), last, usage)
    except (EngineCoreError, APIError) as exc:  # APIError: a parser failed (named)
        error = error_body(status_of(exc), str(exc))["error"]
        yield _event(
            "error", next(seq), code=str(error["code"]), message=error["message"], param=None
        )
        return
    if "message" not in opened:
        for event in open_message():
            yield event
    full = "".join(text)
    yield _event("response.output_text.done", next(seq), text=full, logprobs=[], **where)
    yield _event("response.content_part.done", next(seq), part={**part, "text": full}, **where)
    yield _event(
        "response.output_item.done",
        next(seq),
        output_index=where["output_index"],
        item=_message_item(item_id, full, "completed"),
    )
    yield _event("response.completed", next(seq), response=completed)
