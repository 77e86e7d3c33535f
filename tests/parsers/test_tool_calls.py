"""Tool calls in /v1/chat/completions: the hermes parser, the parser hook, and the real
server driven by the real ``openai`` client.

The end-to-end tests serve ``EchoForCausalLM`` from ``tests/plugins/enginecore-echo-model``,
a model plugin pip-installed into a private target directory and found through its
entry point: it replies with the span of its prompt marked by ``<|pad|>`` tokens, so each
test chooses the model's exact output (a tool call, two, malformed ones, plain text) and
the whole path runs for real: template, engine, paged KV cache, sampler, detokenizer,
parser, HTTP, SSE.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from enginecore import LLM, SamplingParams
from enginecore.server.errors import APIError
from enginecore.server.protocol import ChatCompletionRequest
from enginecore.server.tools import plan_tools
from enginecore.tool_parsers import ParsedText, PartialToolCall, ToolParser
from enginecore_tool_parsers.hermes import HermesToolParser
from tests.helpers.echo_model import CALL, PAD, TIME, WEATHER, stream_whole
from tests.helpers.plugin_host import bare_host, registering
from tests.helpers.serve_process import free_port, serve, start_cli, stop

# --- the hermes parser, on strings ---------------------------------------------------------


def test_hermes_extracts_content_and_calls():
    text = (
        f'Let me check.\n{CALL}\n<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>'
    )
    result = HermesToolParser().extract_tool_calls(text)
    assert result.content == "Let me check.\n"
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(result.tool_calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert result.tool_calls[1].arguments == "{}"
    assert len({c.id for c in result.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in result.tool_calls)


@pytest.mark.parametrize(
    "text",
    [
        "no tool call at all",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        f"{CALL}<tool_call>[1, 2]</tool_call>",  # one bad call spoils the reply
    ],
)
def test_hermes_returns_text_as_content_when_there_is_no_valid_call(text):
    result = HermesToolParser().extract_tool_calls(text)
    assert result.tool_calls == [] and result.content == text


def test_hermes_accepts_a_last_call_without_closing_tag_and_parameters_key():
    text = '<tool_call>{"name": "get_time", "parameters": {"tz": "UTC"}}'
    (call,) = HermesToolParser().extract_tool_calls(text).tool_calls
    assert call.name == "get_time" and json.loads(call.arguments) == {"tz": "UTC"}


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_streaming_deltas_add_up_to_the_whole_result(step):
    text = f'Sure: {CALL}\n<tool_call>{{"name": "get_time", "arguments": {{"tz": "<UTC>"}}}}</tool_call>'
    whole = HermesToolParser().extract_tool_calls(text)
    content, calls, deltas = stream_whole(HermesToolParser(), text, step)
    assert content == whole.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    if step == 1:
        fragments = [d for delta in deltas for d in delta.get("tool_calls", []) if "id" not in d]
        assert len(fragments) > 5, "arguments stream in fragments, not at the end"
        assert not any("<" in delta.get("content", "") for delta in deltas), "marker held back"


def test_streaming_releases_held_back_text_that_was_not_a_marker():
    content, calls, _ = stream_whole(HermesToolParser(), "a < b and <tool", 1)
    assert content == "a < b and <tool" and calls == []


# --- the hook and the plan ---------------------------------------------------------------


class AnswerTagParser(ToolParser):
    """A third-party format: ``ANSWER:name:{json}``."""

    def parse(self, text: str, final: bool) -> ParsedText:
        head, sep, tail = text.partition("ANSWER:")
        if not sep or not final:
            return ParsedText(content=head if sep else (text if final else ""))
        name, _, args = tail.partition(":")
        try:
            json.loads(args)
        except ValueError:
            return ParsedText(content=head, calls=[PartialToolCall(invalid=True)])
        return ParsedText(content=head, calls=[PartialToolCall(name, args)])


def test_hook_register_tool_parsers():
    host = bare_host(
        ("builtin", __import__("enginecore_tool_parsers.plugin", fromlist=["_"])),
        ("answers", registering("register_tool_parsers", "answer_tag", AnswerTagParser)),
    )
    registry = host.registry("tool_parser")
    assert {n: registry.entry(n).plugin for n in registry} == {
        "hermes": "builtin",
        "llama3_json": "builtin",
        "mistral": "builtin",
        "pythonic": "builtin",
        "qwen3_coder": "builtin",
        "answer_tag": "answers",
    }
    parser = registry.get("answer_tag")(None)
    result = parser.extract_tool_calls('ok ANSWER:get_time:{"tz": "UTC"}')
    assert result.content == "ok " and result.tool_calls[0].name == "get_time"
    assert registry.get("hermes")(None).extract_tool_calls(CALL).tool_calls[0].name == (
        "get_weather"
    )


def _plan(body: dict, **kw):
    defaults = dict(
        enable_auto_tool_choice=True,
        parser_registry=bare_host(
            ("builtin", __import__("enginecore_tool_parsers.plugin", fromlist=["_"]))
        ).registry("tool_parser"),
        parser_name="hermes",
        backend_registry=None,
        backend_name="xgrammar",
        tokenizer=None,
    )
    defaults.update(kw)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    return plan_tools(request, **defaults)


def test_plan_defaults_and_schemas():
    assert _plan({}).mode == "none"
    assert _plan({"tools": [WEATHER]}).mode == "auto"
    assert _plan({"tools": [WEATHER], "tool_choice": "none"}).mode == "none"
    backends = bare_host(
        ("so", registering("register_structured_output_backends", "xgrammar", object))
    ).registry("structured_output_backend")
    named = _plan(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        backend_registry=backends,
    )
    assert named.mode == "named" and named.function_name == "get_weather"
    assert named.structured_output.json == WEATHER["function"]["parameters"]
    required = _plan(
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
        backend_registry=backends,
    )
    schema = required.structured_output.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]


@pytest.mark.parametrize(
    ("body", "kw", "message"),
    [
        ({"tool_choice": "auto"}, {}, "needs a non-empty 'tools' list"),
        ({"tools": [WEATHER]}, {"enable_auto_tool_choice": False}, "--enable-auto-tool-choice"),
        ({"tools": [WEATHER]}, {"parser_name": None}, "--tool-call-parser"),
        ({"tools": [WEATHER, WEATHER]}, {}, "must be unique"),
        ({"tools": [WEATHER], "tool_choice": "required"}, {}, "no structured-output backend"),
    ],
)
def test_plan_rejects_what_cannot_work(body, kw, message):
    with pytest.raises(APIError, match=message) as info:
        _plan(body, **kw)
    assert info.value.status == 400


def test_llm_chat_passes_tools_to_the_template(tiny_llama) -> None:
    template = (
        "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}; {% endif %}"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=1)
    with LLM(tiny_llama, dtype="float32", multiprocessing=False) as llm:
        with_tools = llm.chat(messages, params, chat_template=template, tools=tools)[0]
        without = llm.chat(messages, params, chat_template=template)[0]
        tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(with_tools.prompt_token_ids) == "tools: get_weather; hi\n"
    assert tokenizer.decode(without.prompt_token_ids) == "hi\n"


# --- end to end: the real server on the echo model ------------------------------------------


@pytest.fixture(scope="module")
def server(echo_env, echo_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("echo-server") / "server.log"
    flags = ["--num-blocks-override", "200", "--max-num-batched-tokens", "32"]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc, url = serve(echo_checkpoint, log_path, *flags, env=echo_env)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _says(text: str) -> list[dict]:
    """A conversation whose (echo-model) reply is exactly ``text``."""
    return [{"role": "user", "content": f"Please answer {PAD}{text}{PAD}"}]


def _chat(client, text: str, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=_says(text), temperature=0, **kw
    )


def test_echo_model_replies_with_the_marked_text(client):
    out = _chat(client, "Plain words, no tools.")
    assert out.choices[0].message.content == "Plain words, no tools."
    assert out.choices[0].finish_reason == "stop"


def test_auto_tool_call_non_streaming(server, client, echo_checkpoint):
    out = _chat(client, f"Let me check.{CALL}", tools=[WEATHER, TIME])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    # The tools reached the chat template: the prompt is the template rendered with them.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(echo_checkpoint)
    rendered = tokenizer.apply_chat_template(
        _says(f"Let me check.{CALL}"), tools=[WEATHER, TIME], add_generation_prompt=True
    )
    rendered = rendered if isinstance(rendered, list) else rendered["input_ids"]
    without = tokenizer.apply_chat_template(
        _says(f"Let me check.{CALL}"), add_generation_prompt=True
    )
    without = without if isinstance(without, list) else without["input_ids"]
    assert out.usage.prompt_tokens == len(rendered) > len(without)
    counted = httpx.post(
        f"{server}/tokenize",
        json={"messages": _says(f"Let me check.{CALL}"), "tools": [WEATHER, TIME]},
    )
    assert counted.json()["tokens"] == rendered  # /tokenize renders tools the same way


def test_auto_tool_calls_streaming(client):
    text = f'Checking.{CALL}<tool_call>{{"name": "get_time", "arguments": {{"tz": "UTC"}}}}</tool_call>'
    whole = _chat(client, text, tools=[WEATHER, TIME])
    stream = _chat(client, text, tools=[WEATHER, TIME], stream=True)
    content, calls, fragments, finish = "", [], 0, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for item in delta.tool_calls or []:
            if item.index == len(calls):
                assert item.id and item.type == "function" and item.function.name
                calls.append([item.id, item.function.name, item.function.arguments or ""])
            else:
                assert item.id is None and item.function.name is None
                calls[item.index][2] += item.function.arguments or ""
                fragments += 1
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert content == whole.choices[0].message.content == "Checking."
    expected = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert [(name, args) for _, name, args in calls] == expected
    assert fragments > 2, "arguments arrive as fragments while the model writes them"


def test_parallel_tool_calls_false_keeps_the_first(client):
    text = f'{CALL}<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>'
    out = _chat(client, text, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_and_malformed_calls_are_content(client):
    out = _chat(client, CALL, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content == CALL
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    out = _chat(client, bad, tools=[WEATHER])
    assert out.choices[0].message.content == bad and out.choices[0].finish_reason == "stop"


def test_a_call_cut_by_max_tokens_is_content_with_finish_reason_length(client):
    out = _chat(client, CALL, tools=[WEATHER], max_tokens=8)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert CALL.startswith(choice.message.content) and choice.message.content
    finishes = [
        c.choices[0].finish_reason
        for c in _chat(client, CALL, tools=[WEATHER], max_tokens=8, stream=True)
        if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]


def test_a_tool_round_trip_conversation(client, echo_checkpoint):
    """The assistant's tool call and the tool's result go back in; arguments sent as JSON
    text reach the template as objects (as chat templates expect)."""
    first = _chat(client, CALL, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *_says(CALL),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        {"role": "user", "content": f"{PAD}It is 21 degrees in Paris.{PAD}"},
    ]
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, tools=[WEATHER], temperature=0
    )
    assert out.choices[0].message.content == "It is 21 degrees in Paris."
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(echo_checkpoint)
    as_objects = json.loads(json.dumps(messages))
    as_objects[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    rendered = tokenizer.apply_chat_template(
        as_objects, tools=[WEATHER], add_generation_prompt=True
    )
    rendered = rendered if isinstance(rendered, list) else rendered["input_ids"]
    assert out.usage.prompt_tokens == len(rendered)


def test_text_content_parts_are_accepted_and_images_are_400(client):
    model = client.models.list().data[0].id
    parts = [{"type": "text", "text": f"Say {PAD}two "}, {"type": "text", "text": f"parts{PAD}"}]
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], temperature=0
    )
    assert out.choices[0].message.content == "two parts"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="'image_url' are not supported"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": [parts[0], image]}]
        )


def test_a_named_tool_choice_outside_tools_is_400(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _chat(client, "{}", tools=[TIME], tool_choice=named)


def test_named_and_required_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    args = '{"city": "Paris"}'
    out = _chat(client, args, tools=[WEATHER, TIME], tool_choice=named)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    listed = '[{"name": "get_time", "parameters": {}}]'
    out = _chat(client, listed, tools=[WEATHER, TIME], tool_choice="required")
    assert out.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_time"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-auto-tool-choice"], "needs server.tool_call_parser"),
        (["--tool-call-parser", "nope"], "hermes"),
    ],
)
def test_bad_tool_settings_stop_the_server_at_startup(
    echo_env, echo_checkpoint, tmp_path, flags, message
):
    args = ["serve", str(echo_checkpoint), "--port", str(free_port()), *flags]
    proc = start_cli(args, tmp_path / "log", echo_env)
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "log").read_text()
    assert code != 0 and message in log, log


def test_named_and_required_calls_have_empty_string_content(client):
    """As vLLM sends them: client code written for vLLM takes len(message.content)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(client, '{"city": "Paris"}', tools=[WEATHER], tool_choice=named)
    assert out.choices[0].message.content == "" and len(out.choices[0].message.tool_calls) == 1
    listed = '[{"name": "get_time", "parameters": {}}]'
    out = _chat(client, listed, tools=[WEATHER, TIME], tool_choice="required")
    assert out.choices[0].message.content == "" and len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("reply", "choice"),
    [
        ('{"city": "Paris"}', {"type": "function", "function": {"name": "get_weather"}}),
        ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "required"),
    ],
)
def test_a_call_cut_short_by_max_tokens_is_no_tool_call(client, reply, choice, stream):
    """A constrained reply cut short (``{"c``) is text, never a call with broken arguments."""
    kw = dict(tools=[WEATHER], tool_choice=choice, max_tokens=2)
    if not stream:
        out = _chat(client, reply, **kw)
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].message.tool_calls is None
        assert reply.startswith(out.choices[0].message.content)
        return
    chunks = [c for c in _chat(client, reply, stream=True, **kw) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    if choice == "required":  # read whole at the end: never announced as a call
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
