"""Each built-in tool-call format through the real server and the real ``openai`` client.

The echo-model plugin (``tests/plugins/enginecore-echo-model``) replies with exactly the
text marked in its prompt, so the reply is a model family's real tool-call output and the
whole path runs: chat template with the tools, engine, detokenizer, the selected parser,
HTTP, SSE. ``qwen3_coder`` runs in the default suite (it also needs the request's tool
schemas, which only the server hands it); the others are slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from tests.helpers.echo_model import PAD, TIME
from tests.helpers.serve_process import serve, stop

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}

REPLIES = {
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}, {"name": "get_time", "arguments": {}}]',
    "pythonic": "[get_weather(city='Paris', days=3), get_time()]",
}
CONTENT = {"qwen3_coder": "Checking.\n", "mistral": "Checking."}
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]


def _with_control_tokens(checkpoint: Path, tmp_path_factory) -> Path:
    """The checkpoint with ``[TOOL_CALLS]`` and ``[ARGS]`` as special tokens, as in Mistral's
    tokenizers: a reply detokenized without special tokens would lose them."""
    from transformers import AutoTokenizer, LlamaConfig

    out = tmp_path_factory.mktemp("mistral-echo")
    shutil.copytree(checkpoint, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tokenizer.save_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("[TOOL_CALLS]"), skip_special_tokens=True) == ""
    config = LlamaConfig.from_pretrained(out)
    config.vocab_size = len(tokenizer)
    config.save_pretrained(out)
    return out


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_coder",
        pytest.param("llama3_json", marks=pytest.mark.slow),
        pytest.param("mistral", marks=pytest.mark.slow),
        pytest.param("pythonic", marks=pytest.mark.slow),
    ],
)
def served(request, echo_env, echo_checkpoint, tmp_path_factory):
    name = request.param
    if name == "mistral":
        echo_checkpoint = _with_control_tokens(echo_checkpoint, tmp_path_factory)
    log_path = tmp_path_factory.mktemp(f"{name}-server") / "server.log"
    flags = ["--num-blocks-override", "200", "--max-num-batched-tokens", "64"]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", name]
    proc, url = serve(echo_checkpoint, log_path, *flags, env=echo_env)
    yield name, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stop(proc)


def _chat(client, text: str, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": f"Answer {PAD}{text}{PAD}"}],
        tools=[WEATHER, TIME],
        temperature=0,
        **kw,
    )


def test_the_format_parses_into_calls_whole_and_streamed(served):
    name, client = served
    whole = _chat(client, REPLIES[name]).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == CONTENT.get(name)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert got == EXPECTED
    content, calls, finish = "", [], None
    for chunk in _chat(client, REPLIES[name], stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for item in choice.delta.tool_calls or []:
            if item.index == len(calls):
                assert item.id and item.function.name
                calls.append([item.function.name, ""])
            calls[item.index][1] += item.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == (CONTENT.get(name) or "")
    assert [(n, json.loads(a)) for n, a in calls] == EXPECTED


def test_tool_choice_none_and_parallel_calls_off(served):
    name, client = served
    out = _chat(client, REPLIES[name], tool_choice="none").choices[0]
    # Without the parser, control tokens are not detokenized (as in vLLM).
    plain = REPLIES[name].replace("[TOOL_CALLS]", "") if name == "mistral" else REPLIES[name]
    assert out.message.content == plain and out.message.tool_calls is None
    out = _chat(client, REPLIES[name], parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in out.message.tool_calls] == ["get_weather"]


def test_plain_text_stays_content(served):
    _, client = served
    out = _chat(client, "It is sunny in Paris.").choices[0]
    assert out.message.content == "It is sunny in Paris." and out.finish_reason == "stop"
