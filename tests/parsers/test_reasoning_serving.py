"""Reasoning over HTTP: ``--reasoning-parser qwen3`` on a Qwen3-shaped checkpoint, through
the real ``openai`` client.

The checkpoint is the echo-model plugin's (``tests/plugins/enginecore-echo-model``: it
replies with the span of its prompt between ``<|pad|>`` tokens) given Qwen3's shape: a
``Qwen3Config``, ``<think>``/``</think>`` as added tokens, and a chat template that,
like Qwen3's, closes an empty think block in the prompt when ``enable_thinking`` is
false. So each test chooses the reply's exact text and the whole path runs for real:
template, engine, structured output, detokenizer, parsers, HTTP, SSE.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.echo_model import CALL, ECHO_PLUGIN, PAD, WEATHER
from tests.helpers.serve_process import serve, stop

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location(
        "echo_checkpoint", ECHO_PLUGIN / "src" / "enginecore_echo_model" / "checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.make_echo_checkpoint(tmp_path_factory.mktemp("qwen3-echo"))
    from transformers import AutoTokenizer, LlamaConfig, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's tokenizer: added, not special
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(out)
    echo = LlamaConfig.from_pretrained(out)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
        bos_token_id=echo.bos_token_id,
        eos_token_id=echo.eos_token_id,
        pad_token_id=echo.pad_token_id,
        architectures=["EchoForCausalLM"],
    )
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(echo_env, qwen3_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("qwen3-server") / "server.log"
    flags = ["--num-blocks-override", "200", "--max-num-batched-tokens", "64"]
    flags += ["--reasoning-parser", "qwen3"]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    # Each step takes 5 ms, so the reply streams in pieces even on a loaded host.
    env = dict(echo_env, ECHO_MODEL_STEP_DELAY_S="0.005")
    proc, url = serve(qwen3_checkpoint, log_path, *flags, env=env)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _says(text: str) -> list[dict]:
    return [{"role": "user", "content": f"Please answer {PAD}{text}{PAD}"}]


def _chat(client, text: str, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=_says(text), temperature=0, **kw
    )


THOUGHT = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"


def _field(obj, name):
    return (obj.model_extra or {}).get(name)


def test_reasoning_content_is_separate(client):
    message = _chat(client, THOUGHT).choices[0].message
    assert message.content == "\n\nHello there!"
    assert _field(message, "reasoning_content") == "\nThe user wants a greeting.\n"
    assert _field(message, "reasoning") == _field(message, "reasoning_content")


def test_reasoning_content_streamed(client):
    reasoning = content = ""
    order = []
    for chunk in _chat(client, THOUGHT, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = _field(delta, "reasoning_content")
        if piece:
            assert _field(delta, "reasoning") == piece
            reasoning += piece
            order.append("r")
        if delta.content:
            content += delta.content
            order.append("c")
    assert reasoning == "\nThe user wants a greeting.\n" and content == "\n\nHello there!"
    assert order.index("c") > len([o for o in order if o == "r"]) - 1, "reasoning comes first"
    assert len([o for o in order if o == "r"]) > 1, "reasoning streams as it is written"


def test_include_reasoning_false_drops_the_thinking(client):
    out = _chat(client, THOUGHT, extra_body={"include_reasoning": False})
    message = out.choices[0].message
    assert message.content == "\n\nHello there!" and _field(message, "reasoning_content") is None
    chunks = list(_chat(client, THOUGHT, stream=True, extra_body={"include_reasoning": False}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(_field(d, "reasoning_content") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "\n\nHello there!"


def test_cut_short_while_thinking_is_all_reasoning(client):
    out = _chat(client, THOUGHT, max_tokens=4)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.content is None and _field(message, "reasoning_content")


def test_enable_thinking_false_reaches_the_template(client):
    """The template closes the think block in the prompt: the reply is all content, even
    text that looks like a think block."""
    out = _chat(client, THOUGHT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert message.content == THOUGHT and _field(message, "reasoning_content") is None
    thinking = _chat(client, THOUGHT)
    assert out.usage.prompt_tokens > thinking.usage.prompt_tokens  # the closed block


def test_tool_call_after_reasoning(client):
    out = _chat(client, f"<think>I need the weather.</think>{CALL}", tools=[WEATHER])
    choice = out.choices[0]
    assert _field(choice.message, "reasoning_content") == "I need the weather."
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_structured_output_applies_after_the_reasoning(client):
    """The think block is free text the schema would refuse; the answer follows the schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = '{"city": "Paris"}'
    out = _chat(
        client,
        f"<think>Paris, surely. [not json]</think>{answer}",
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    message = out.choices[0].message
    assert _field(message, "reasoning_content") == "Paris, surely. [not json]"
    assert json.loads(message.content) == {"city": "Paris"}
    # Thinking disabled: the prompt ended the reasoning, so the schema applies at once.
    out = _chat(
        client,
        answer,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert json.loads(out.choices[0].message.content) == {"city": "Paris"}


def test_responses_api_returns_a_reasoning_item(client, server):
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input=_says(THOUGHT)[0]["content"])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.content[0].text == "\nThe user wants a greeting.\n"
    assert response.output_text == "\n\nHello there!"
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with_effort = httpx.post(
        f"{server}/v1/responses",
        json={"model": model, "input": _says(THOUGHT)[0]["content"], "reasoning": {}},
    )
    assert with_effort.status_code == 200, with_effort.text


def test_responses_api_streams_reasoning_then_text(client):
    model = client.models.list().data[0].id
    events = list(
        client.responses.create(model=model, input=_says(THOUGHT)[0]["content"], stream=True)
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == "\nThe user wants a greeting.\n" and text == "\n\nHello there!"
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]


# --- streamed answers equal the non-streamed ones -----------------------------------------

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
#: Replies whose streamed deltas, put together, must give the non-streamed message: the
#: final parse at the end of a stream (tool calls, reasoning) included.
WHOLE_VS_STREAMED = {
    "reasoning_then_content": THOUGHT,
    "reasoning_then_call": f"<think>I need the weather.</think>{CALL}",
    "content_then_call": f"Let me check.\n{CALL}",
    "two_calls_and_trailing_text": f"<think>Two cities.</think>{CALL}\n<tool_call>{PARIS}"
    "</tool_call>\nDone.",
    "call_inside_the_thinking": f"<think>Maybe {CALL}?</think>No call after all.",
    "malformed_call": '<think>Try.</think><tool_call>{"name": "get_weather", "arguments": '
    "{city: Paris}}</tool_call>",
    "unterminated_call": f"<think>Try.</think><tool_call>{PARIS}",
    "cut_short_in_a_call": f"<think>Go.</think>{CALL}",
    "cut_short_while_thinking": THOUGHT,
}
MAX_TOKENS = {"cut_short_in_a_call": 16, "cut_short_while_thinking": 5}
#: A call malformed after the stream announced it (as in vLLM, a call streams while it is
#: written): it cannot be taken back, but the stream then carries the whole text as
#: content and finishes with ``stop``, as the whole answer does; nothing is lost.
ANNOUNCED_THEN_MALFORMED = {"malformed_call"}


def _whole(choice) -> dict:
    message = choice.message
    calls = [(c.function.name, c.function.arguments, c.type) for c in message.tool_calls or []]
    return {
        "content": message.content or "",
        "reasoning": _field(message, "reasoning_content") or "",
        "tool_calls": calls,
        "finish_reason": choice.finish_reason,
    }


def _streamed(chunks) -> dict:
    content = reasoning = ""
    calls: list[list] = []
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += _field(delta, "reasoning_content") or ""
        for item in delta.tool_calls or []:
            if item.index == len(calls):
                assert item.id and item.function.name, "the first delta names the call"
                calls.append([item.function.name, "", item.type])
            calls[item.index][1] += item.function.arguments or ""
        finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [tuple(c) for c in calls],
        "finish_reason": finish,
    }


@pytest.mark.parametrize("case", sorted(WHOLE_VS_STREAMED))
def test_the_streamed_answer_equals_the_whole_one(client, case):
    """qwen3 reasoning and hermes tool calls together, as Qwen3 is served."""
    kw = dict(tools=[WEATHER], max_tokens=MAX_TOKENS.get(case, 200))
    whole = _whole(_chat(client, WHOLE_VS_STREAMED[case], **kw).choices[0])
    streamed = _streamed(_chat(client, WHOLE_VS_STREAMED[case], stream=True, **kw))
    if case in ANNOUNCED_THEN_MALFORMED:
        assert whole["tool_calls"] == [] and whole["finish_reason"] == "stop"
        assert [name for name, _, _ in streamed.pop("tool_calls")] == ["get_weather"]
        whole.pop("tool_calls")
    assert streamed == whole
