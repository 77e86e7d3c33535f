"""Plugin code the API server runs for every client is bounded and named.

Through the real server with ``tests/plugins/enginecore-broken-parts`` installed: a tool
parser that hangs and a reasoning parser that raises fail only the requests they parse,
with a 500 naming the parser, its plugin, the config key that selected it and the
method; a stat logger that hangs in ``record`` is disabled and named once; every other
request keeps being served and ``/health`` stays 200. (Stat loggers under ``LLM`` are
driven by ``test_every_kind_contained.py``.)
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.helpers.serve_process import serve, stop

PLUGIN = "plugin 'broken_parts' (distribution enginecore-broken-parts 0.1.0)"
LIMIT = ["--frontend-plugin-timeout", "1", "--max-model-len", "512"]
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}
MESSAGES = [{"role": "user", "content": "hello"}]


def _others_are_served(client: openai.OpenAI, url: str, model: str) -> None:
    done = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def _stream_error(url: str, model: str, **body) -> str:
    """The text of a streamed chat reply (status line and events) that a parser failed."""
    payload = {"model": model, "messages": MESSAGES, "max_tokens": 4, "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=60) as reply:
        return f"{reply.status_code} {reply.read().decode()}"


@pytest.mark.slow
def test_a_hanging_tool_parser_and_stat_logger_fail_only_their_own_work(
    broken_env, tiny_llama, tmp_path
):
    log = tmp_path / "serve.log"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hanging_tool_parser"]
    flags += ["--stat-loggers", "logging,record_hanging_logger", *LIMIT]
    proc, url = serve(tiny_llama, log, *flags, env=broken_env)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        named = (
            f"tool parser 'hanging_tool_parser' from {PLUGIN}, config key "
            "server.tool_call_parser: in HangingToolParser.parse did not return within 1 s "
            "(config key engine.frontend_plugin_timeout)"
        )
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(
                model=model, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=4
            )
        assert named in str(failed.value), failed.value
        assert named in _stream_error(url, model, tools=[WEATHER_TOOL])
        assert time.monotonic() - started < 50  # bounded, not held by the hung parser
        # The requests the parser does not parse are served.
        plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
        assert plain.choices[0].finish_reason == "length"
        _others_are_served(client, url, model)
        lines = [line for line in log.read_text().splitlines() if "record_hanging_logger" in line]
        disabled = [line for line in lines if "it is disabled" in line]
        assert len(disabled) == 1, lines
        assert "in RecordHangingStatLogger.record" in disabled[0], disabled
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_raising_reasoning_parser_fails_only_the_chat_requests(broken_env, tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    flags = ["--reasoning-parser", "raising_reasoning_parser", *LIMIT]
    proc, url = serve(tiny_llama, log, *flags, env=broken_env)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        named = (
            f"reasoning parser 'raising_reasoning_parser' from {PLUGIN}, config key "
            "server.reasoning_parser: in RaisingReasoningParser.parse raised RuntimeError: "
            "think markers table missing"
        )
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        assert named in str(failed.value), failed.value
        assert named in _stream_error(url, model)
        _others_are_served(client, url, model)
    finally:
        stop(proc)
