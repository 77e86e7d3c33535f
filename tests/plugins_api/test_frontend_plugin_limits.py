"""Plugin code the API server runs for every client is bounded and named.

Through the real server with ``tests/plugins/enginecore-broken-parts`` installed: a tool
parser that hangs and a reasoning parser that raises fail only the requests they parse,
with a 500 naming the parser, its plugin, the config key that selected it and the
method (at most 4 calls of a parser past its limit are kept: past them a request that
needs it is refused with a 503 naming it); a stat logger that hangs in ``record`` is
disabled and named once; every other request keeps being served and ``/health`` stays
200. (Stat loggers under ``LLM`` are
driven by ``test_every_kind_contained.py``.)

A parser held past its limit holds only its own request: the server waits for it off the
event loop, so another client's completion sent meanwhile is answered first.
"""

from __future__ import annotations

import json
import threading
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
        # Its abandoned calls are capped at 4: past them a request that needs it is refused
        # at once (their threads are held until the calls return, here never).
        for _ in range(2):
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(
                    model=model, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=4
                )
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=model, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=4
            )
        assert refused.value.status_code == 503
        assert (
            f"tool parser 'hanging_tool_parser' from {PLUGIN}, config key "
            "server.tool_call_parser: refused while 4 of its calls that did not return within "
            "the limit (config key engine.frontend_plugin_timeout) still run"
        ) in str(refused.value), refused.value
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


@pytest.mark.slow
def test_a_hung_parser_holds_only_its_own_request(broken_env, tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hanging_tool_parser"]
    flags += ["--frontend-plugin-timeout", "15", "--max-model-len", "512"]
    proc, url = serve(tiny_llama, log, *flags, env=broken_env)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        answered: list[str] = []
        errors: list[str] = []

        def hung_request() -> None:
            try:
                client.chat.completions.create(
                    model=model, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=4
                )
            except openai.InternalServerError as exc:
                errors.append(str(exc))
            answered.append("hung parser's reply")

        held = threading.Thread(target=hung_request)
        held.start()
        deadline = time.monotonic() + 60
        while "hanging_tool_parser: parse entered" not in log.read_text():
            assert held.is_alive() and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        # The parser now holds its request; another client's completion is served meanwhile.
        done = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
        assert done.choices[0].finish_reason == "length"
        answered.append("other client's completion")
        held.join(120)
        assert answered == ["other client's completion", "hung parser's reply"]
        assert (
            len(errors) == 1 and "HangingToolParser.parse did not return within 15 s" in errors[0]
        )
    finally:
        stop(proc)


def _responses_stream(url: str, model: str) -> tuple[int, list[dict]]:
    """A streamed Responses request: its status and the events received before the end."""
    payload = {"model": model, "input": "hello", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=payload, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
        return reply.status_code, [json.loads(line[len("data: ") :]) for line in lines]


@pytest.mark.slow
def test_a_hanging_reasoning_parser_fails_only_its_own_requests(broken_env, tiny_llama, tmp_path):
    """Chat (plain and streamed) and a streamed Responses request end past the 1 s limit
    naming the parser, its plugin, its config key and the method; others are served."""
    flags = ["--reasoning-parser", "hanging_reasoning_parser", *LIMIT]
    proc, url = serve(tiny_llama, tmp_path / "serve.log", *flags, env=broken_env)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        named = (
            f"reasoning parser 'hanging_reasoning_parser' from {PLUGIN}, config key "
            "server.reasoning_parser: in HangingReasoningParser.parse did not return within "
            "1 s (config key engine.frontend_plugin_timeout)"
        )
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        assert named in str(failed.value), failed.value
        assert named in _stream_error(url, model)
        status, events = _responses_stream(url, model)
        assert status == 200 and events[-1]["type"] == "error", events
        assert named in events[-1]["message"], events[-1]
        assert time.monotonic() - started < 50  # bounded, not held by the hung parser
        _others_are_served(client, url, model)
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_reasoning_parser_failing_on_the_whole_reply_sends_an_error_event(
    broken_env, tiny_llama, tmp_path
):
    """A parser whose streamed deltas parse but whose whole-reply split raises: the
    streamed Responses request ends with an ``error`` event naming it (not a broken
    connection, not a completed response); plain Responses gets a 500 naming it."""
    flags = ["--reasoning-parser", "final_raising_reasoning_parser", *LIMIT]
    proc, url = serve(tiny_llama, tmp_path / "serve.log", *flags, env=broken_env)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        named = (
            f"reasoning parser 'final_raising_reasoning_parser' from {PLUGIN}, config key "
            "server.reasoning_parser: in FinalRaisingReasoningParser.extract_reasoning raised "
            "RuntimeError: think markers unbalanced"
        )
        status, events = _responses_stream(url, model)
        assert status == 200, events
        kinds = [event["type"] for event in events]
        assert kinds[-1] == "error" and "response.completed" not in kinds, kinds
        assert named in events[-1]["message"], events[-1]
        with pytest.raises(openai.InternalServerError) as failed:
            client.responses.create(model=model, input="hello", max_output_tokens=4)
        assert named in str(failed.value), failed.value
        _others_are_served(client, url, model)
    finally:
        stop(proc)
