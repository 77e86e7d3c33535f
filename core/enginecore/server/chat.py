"""``POST /v1/chat/completions``: the tokenizer's chat template, then generation."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from enginecore.engine.output import OutputKind, RequestOutput
from enginecore.errors import EngineCoreError
from enginecore.reasoning_parsers import ReasoningParser
from enginecore.server.beam import beam_search_output, beam_search_params, single
from enginecore.server.contained_parsers import run_parsing
from enginecore.server.context import ServerContext, context
from enginecore.server.dp_rank import requested_rank
from enginecore.server.errors import APIError, error_body, status_of
from enginecore.server.limits import check_prompt_tokens
from enginecore.server.logprobs import chat_logprobs, raw_prompt_logprobs
from enginecore.server.protocol import ChatCompletionRequest, ChatMessage, usage
from enginecore.server.reasoning import (
    ChoiceReasoningStream,
    constrain_after_reasoning,
    new_reasoning_parser,
    reasoning_fields,
    split_reasoning,
)
from enginecore.server.sampling import (
    check_max_tokens,
    resolve_logprob_fields,
    to_sampling_params,
    truncate_prompt,
)
from enginecore.server.stream_buffer import buffered
from enginecore.server.streaming import (
    DONE,
    SSE_HEADERS,
    ClientDisconnected,
    aborting_when_left,
    sse,
    unless_disconnected,
)
from enginecore.server.tools import ToolPlan, message, plan_tools

router = APIRouter()


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined into one string, and
    tool-call arguments (JSON text on the wire) as objects, as templates index them."""
    result = []
    for i, msg in enumerate(messages):
        data = msg.model_dump(exclude_none=True)
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}]: content parts of type {kind!r} are not "
                        "supported (this server serves text models: only 'text' parts with a "
                        "string 'text')",
                        param="messages",
                    )
                texts.append(part["text"])
            data["content"] = "".join(texts)
        elif content is None:
            data["content"] = ""
        for call in data.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                # Not JSON: the template gets the text as sent.
                with contextlib.suppress(ValueError):
                    function["arguments"] = json.loads(function["arguments"])
        result.append(data)
    return result


#: apply_chat_template parameters a client may set through chat_template_kwargs: data the
#: template renders. The others steer tokenization (padding to max_length=10^8 answered a
#: 100-byte request with 10^8 tokens; return_tensors gave a 500; sanitize_control_tokens).
TEMPLATE_DATA_PARAMETERS = frozenset({"tools", "documents"})


def _check_template_variables(kwargs: dict[str, Any], tokenizer: Any) -> None:
    """chat_template_kwargs are template variables only, never apply_chat_template's own
    parameters."""
    try:
        signature = inspect.signature(tokenizer.apply_chat_template)
    except (TypeError, ValueError, AttributeError):
        return
    named = {
        name
        for name, parameter in signature.parameters.items()
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
    }
    refused = sorted((set(kwargs) & named) - TEMPLATE_DATA_PARAMETERS)
    if refused:
        raise APIError(
            400,
            f"chat_template_kwargs may only hold template variables; {', '.join(refused)} "
            "set how the tokenizer renders or encodes the conversation",
            param="chat_template_kwargs",
        )


def chat_prompt_ids(
    ctx: ServerContext, body: Any, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The rendered conversation; ``body`` is a chat or a ``/tokenize`` request."""
    if getattr(body, "chat_template", None) is not None and not (
        ctx.limits.trust_request_chat_template
    ):
        raise APIError(
            400,
            "a chat_template in the request is refused: it would run as a Jinja template in "
            "the server (start it with --trust-request-chat-template to allow it)",
            param="chat_template",
        )
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: send "
            "add_generation_prompt false to continue the final message",
            param="continue_final_message",
        )
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise APIError(
            400,
            "continue_final_message needs the last message to be the assistant's, got "
            f"role {body.messages[-1].role!r}",
            param="continue_final_message",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    _check_template_variables(kwargs, ctx.engine.tokenizer)
    if tools:
        kwargs["tools"] = tools
    prompt_token_ids: list[int] = ctx.engine.chat_prompt(
        message_dicts(body.messages),
        chat_template=getattr(body, "chat_template", None),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=kwargs or None,
    )
    return prompt_token_ids


def _tool_plan(ctx: ServerContext, body: ChatCompletionRequest) -> ToolPlan:
    server = ctx.limits
    plugins = ctx.engine.plugins
    return plan_tools(
        body,
        enable_auto_tool_choice=server.enable_auto_tool_choice,
        parser_registry=plugins.registry("tool_parser") if server.tool_call_parser else None,
        parser_name=server.tool_call_parser,
        backend_registry=plugins.registry("structured_output_backend"),
        backend_name=ctx.config.structured_output.backend,
        tokenizer=ctx.engine.tokenizer,
        parser_timeout=ctx.config.engine.frontend_plugin_timeout,
    )


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text, when it is the reply's own role."""
    if not body.echo:
        return ""
    last = message_dicts(body.messages[-1:])[0]
    return last["content"] if last.get("role") == "assistant" else ""


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = context(request)
    engine = ctx.engine
    lora = ctx.resolve_model(body.model)
    if lora is not None and body.use_beam_search:
        raise APIError(400, "beam search is not served with LoRA adapters", param="model")
    resolve_logprob_fields(body, ctx.limits, ctx.vocab_size)
    num_top = None
    if body.logprobs:
        num_top = body.top_logprobs or 0
    requested = body.max_completion_tokens or body.max_tokens
    defaults = ctx.sampling_defaults
    # The checkpoint's max_new_tokens is a default: the engine cuts it to what fits.
    max_tokens = requested if requested is not None else defaults.get("max_tokens")
    params = to_sampling_params(
        body,
        ctx.limits,
        max_tokens=max_tokens,
        logprobs=num_top,
        vocab_size=ctx.vocab_size,
        defaults=defaults,
    )
    if body.prompt_logprobs is not None:
        params = params.clone(prompt_logprobs=body.prompt_logprobs)
    plan = await run_parsing(
        bool(body.tools and ctx.limits.tool_call_parser), _tool_plan, ctx, body
    )
    if plan.structured_output is not None:
        if params.structured_output is not None:
            raise APIError(
                400,
                f"tool_choice {plan.mode!r} constrains the output itself: it cannot be "
                "combined with another output constraint (response_format)",
                param="tool_choice",
            )
        params = params.clone(structured_output=plan.structured_output)
    # The chat template and tokenizer run off the event loop (a long conversation takes
    # seconds); the request's total is bounded like a completion's.
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, ctx, body, plan.tools)
    check_prompt_tokens([len(prompt_ids)], ctx.limits)
    prompt_ids = truncate_prompt(
        prompt_ids, body.truncate_prompt_tokens, engine.max_model_len, body.truncation_side
    )
    if 0 < len(prompt_ids) < engine.max_model_len:  # else the engine names the prompt's fault
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        check_max_tokens(requested, len(prompt_ids), engine.max_model_len, param)
    reasoner = await run_parsing(
        bool(ctx.limits.reasoning_parser),
        new_reasoning_parser,
        engine.plugins.registry("reasoning_parser"),
        ctx.limits.reasoning_parser,
        engine.tokenizer,
        prompt_ids,
        ctx.config.engine.frontend_plugin_timeout,
    )
    parsing = plan.parser is not None or reasoner is not None
    params = await run_parsing(parsing, constrain_after_reasoning, params, reasoner)
    if any(p is not None and p.keeps_special_tokens for p in (plan.parser, reasoner)):
        params = params.clone(skip_special_tokens=False)  # the markers are special tokens
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.use_beam_search:
        room = engine.max_model_len - len(prompt_ids)
        beam = beam_search_params(
            body,
            beam_width=body.n,
            max_tokens=max(1, room if requested is None else min(requested, room)),
            logprobs=body.logprobs,
        )
        if plan.structured_output is not None:
            raise APIError(
                400,
                f"tool_choice {plan.mode!r} constrains the output: it cannot be combined "
                "with use_beam_search",
                param="tool_choice",
            )
        search = beam_search_output(engine, request_id, prompt_ids, beam, body.n, body.priority)
        if body.stream:
            return StreamingResponse(
                _stream(
                    ctx,
                    body,
                    request_id,
                    created,
                    single(search),
                    prompt_ids,
                    num_top,
                    plan,
                    reasoner,
                ),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        try:
            output = await unless_disconnected(request, search)
        except ClientDisconnected:
            return Response(status_code=499)
        reply = await run_parsing(
            parsing, _response, ctx, body, request_id, created, output, num_top, plan, reasoner
        )
        return JSONResponse(reply)
    kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
    collector = engine.add_request(
        request_id,
        {"prompt_token_ids": prompt_ids},
        params,
        priority=body.priority,
        output_kind=kind,
        data_parallel_rank=requested_rank(body, request),
        lora_request=lora,
    )
    if body.stream:
        outputs = buffered(body, engine.stream(collector))
        stream = _stream(
            ctx, body, request_id, created, outputs, prompt_ids, num_top, plan, reasoner
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
        assert last is not None  # a stream ends with the request's final output
        return last

    try:
        output = await unless_disconnected(request, final())
    except ClientDisconnected:
        return Response(status_code=499)
    reply = await run_parsing(
        parsing, _response, ctx, body, request_id, created, output, num_top, plan, reasoner
    )
    return JSONResponse(reply)


def _response(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    output: RequestOutput,
    num_top: int | None,
    plan: ToolPlan,
    reasoner: ReasoningParser | None = None,
) -> dict[str, Any]:
    echo = _echo_text(body)
    choices = []
    completion_tokens = 0
    for completion in output.outputs:
        completion_tokens += len(completion.token_ids)
        logprobs = None
        if num_top is not None and completion.logprobs is not None:
            logprobs = chat_logprobs(
                completion.logprobs,
                num_top,
                ctx.engine.tokenizer,
                body.return_tokens_as_token_ids,
                body.logprob_token_ids,
            )
        reasoning, text = split_reasoning(reasoner, completion.text)
        reply, called = message(plan, text)
        if reasoner is not None:
            if reasoning is not None and not reply["content"] and not called:
                reply["content"] = None  # as vLLM: a reply that only thought has no content
            reply.update(reasoning_fields(reasoning if body.include_reasoning else None))
        if echo and reply["content"] is not None:
            reply["content"] = echo + reply["content"]
        finish_reason = completion.finish_reason
        if called and plan.mode in ("auto", "required") and finish_reason == "stop":
            finish_reason = "tool_calls"
        choice = {
            "index": completion.index,
            "message": reply,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = completion.token_ids
        choices.append(choice)
    prompt_tokens = len(output.prompt_token_ids)
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": ctx.response_model(body.model),
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, output.num_cached_tokens),
        "kv_transfer_params": output.kv_transfer_params,
    }
    if body.prompt_logprobs is not None and output.prompt_logprobs is not None:
        response["prompt_logprobs"] = raw_prompt_logprobs(output.prompt_logprobs)
    if body.return_token_ids:
        response["prompt_token_ids"] = output.prompt_token_ids
    return response


async def _stream(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    request_id: str,
    created: int,
    outputs: AsyncIterator[RequestOutput],
    prompt_ids: list[int],
    num_top: int | None,
    plan: ToolPlan,
    reasoner: ReasoningParser | None = None,
) -> AsyncIterator[str]:
    options = body.stream_options
    include_usage = ctx.limits.enable_force_include_usage or bool(options and options.include_usage)
    continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": ctx.response_model(body.model),
    }
    prompt_tokens = completion_tokens = cached_tokens = 0

    def chunk(choice: dict[str, Any], **extra: Any) -> str:
        # One choice per chunk, as OpenAI and vLLM stream them; vLLM's field order.
        data = {**base, "choices": [choice]}
        if continuous_usage:
            data["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        elif include_usage:
            data["usage"] = None
        return sse({**data, **extra})

    try:
        # The role comes first, for every choice, before any token is generated; with
        # return_token_ids each role chunk carries the prompt's ids (vLLM sends them there).
        role_extra = {"prompt_token_ids": prompt_ids} if body.return_token_ids else {}
        for i in range(body.n):
            yield chunk(
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
                **role_extra,
            )
        echo = _echo_text(body)
        if echo:
            for i in range(body.n):
                yield chunk(
                    {
                        "index": i,
                        "delta": {"content": echo},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
        tool_streams = {i: plan.stream() for i in range(body.n)}
        reasoning_streams = {i: ChoiceReasoningStream(reasoner) for i in range(body.n)}
        parsing = plan.parser is not None or reasoner is not None

        def split(index: int, text: str, finished: bool) -> tuple[str, dict[str, Any]]:
            """The choice's new ``(reasoning, delta)``: both parsers, in one call."""
            thought, content = reasoning_streams[index].feed(text, finished)
            return thought, tool_streams[index].delta(content, finished)

        async for output in outputs:
            prompt_tokens = len(output.prompt_token_ids)
            cached_tokens = output.num_cached_tokens
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                if not (completion.text or completion.token_ids or completion.finish_reason):
                    continue
                logprobs = None
                if num_top is not None and completion.logprobs:
                    logprobs = chat_logprobs(
                        completion.logprobs,
                        num_top,
                        ctx.engine.tokenizer,
                        body.return_tokens_as_token_ids,
                        body.logprob_token_ids,
                    )
                tools = tool_streams[completion.index]
                finished = completion.finish_reason is not None
                thought, delta = await run_parsing(
                    parsing, split, completion.index, completion.text, finished
                )
                if thought and body.include_reasoning:
                    delta = {**reasoning_fields(thought), **delta}
                finish_reason = completion.finish_reason
                if tools.called and plan.mode in ("auto", "required") and finish_reason == "stop":
                    finish_reason = "tool_calls"
                if not (delta or logprobs or finish_reason):
                    continue  # text held back (it may begin a tool call)
                choice = {
                    "index": completion.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
                if body.return_token_ids:
                    choice["token_ids"] = completion.token_ids
                yield chunk(choice)
        if include_usage:
            final = usage(prompt_tokens, completion_tokens, cached_tokens)
            yield sse({**base, "choices": [], "usage": final})
    except (EngineCoreError, APIError) as exc:  # APIError: a parser failed (named)
        yield sse(error_body(status_of(exc), str(exc)))
    yield DONE
