"""Where a vLLM user's client still differed from `vllm serve`: each behaviour as vLLM's,
through the real ``openai`` client (httpx where the client hides the wire) against a real
``enginecore serve`` on a tiny random Llama: the server/ folder's ``guarded_server``
(every logprob allowed, ``--enable-force-include-usage``, ``--enable-server-load-tracking``;
the hardening module attacks it too)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from enginecore.server.load import LoadTrackingMiddleware, ServerLoad
from enginecore.server.load import router as load_router

USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(guarded_server) -> str:
    return guarded_server.url()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _stream_events(server: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


# --- 1. a -inf logprob is no 500 ------------------------------------------------------------


def test_logprobs_of_tokens_a_grammar_rules_out_are_vllms_floor(client, model):
    """With a structured choice the grammar sets the other tokens' logits to -inf; vLLM
    sends those logprobs as -9999.0 (JSON has no infinity), where a 500 came back."""
    out = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, logprobs=True, top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content in ("yes", "no") and content
    values = [top.logprob for item in content for top in item.top_logprobs]
    assert all(math.isfinite(v) and v >= -9999.0 for v in values)
    assert -9999.0 in values  # five top tokens, at most three the grammar allows
    completion = client.completions.create(
        model=model, prompt="Pick:", max_tokens=3, logprobs=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    tops = completion.choices[0].logprobs.top_logprobs
    assert -9999.0 in [v for top in tops for v in top.values()]


# --- 3. logprobs=-1: the whole vocabulary -----------------------------------------------------


def test_minus_one_logprobs_ask_for_the_whole_vocabulary(client, model, server):
    vocab = httpx.get(f"{server}/tokenizer_info").json()["vocab_size"]
    out = client.completions.create(
        model=model, prompt="hi", max_tokens=1, logprobs=-1,
        extra_body={"return_tokens_as_token_ids": True},  # distinct keys: decoded texts collide
    )  # fmt: skip
    assert len(out.choices[0].logprobs.top_logprobs[0]) == vocab
    chat = client.chat.completions.create(
        model=model, messages=USER, max_tokens=1, logprobs=True, top_logprobs=-1
    )
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab
    raw = client.completions.create(
        model=model, prompt="hello there", max_tokens=1, extra_body={"prompt_logprobs": -1}
    )
    prompt_logprobs = raw.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs[1]) >= vocab


# --- 6. usage and load --------------------------------------------------------------------


def test_usage_names_the_cached_prompt_tokens(client, model):
    prompt = "a shared prefix that fills more than one sixteen token block " * 3
    client.completions.create(model=model, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 16
    chat = client.chat.completions.create(model=model, messages=USER, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0


def test_force_include_usage_sends_usage_without_stream_options(server, model):
    events = _stream_events(
        server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, "stream": True}
    )
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    chat = _stream_events(
        server,
        "/v1/chat/completions",
        {"model": model, "messages": USER, "max_tokens": 2, "stream": True},
    )
    assert chat[-1]["usage"]["completion_tokens"] == 2


def test_load_is_served_and_back_to_zero_after_requests(server, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda _: httpx.post(f"{server}/v1/completions", json=body), range(4)))
    assert [r.status_code for r in done] == [200] * 4
    assert httpx.get(f"{server}/load").json() == {"server_load": 0}


def test_load_counts_a_request_until_its_last_byte():
    """The middleware alone, on a route that streams until told to stop."""
    release = asyncio.Event()

    async def slow() -> StreamingResponse:
        async def body():
            yield b"first"
            await release.wait()
            yield b"last"

        return StreamingResponse(body())

    app = FastAPI()
    app.add_api_route("/v1/completions", slow, methods=["POST"])
    app.state.server_load = ServerLoad()
    app.include_router(load_router)
    app.add_middleware(LoadTrackingMiddleware, load=app.state.server_load)

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            seen = []
            task = asyncio.ensure_future(http.post("/v1/completions"))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if app.state.server_load.in_flight:
                    break
            seen.append((await http.get("/load")).json()["server_load"])
            release.set()
            assert (await task).content == b"firstlast"
            seen.append((await http.get("/load")).json()["server_load"])
            return seen

    assert asyncio.run(scenario()) == [1, 0]


# --- 7. routes and fields vLLM serves ----------------------------------------------------------


def test_version_is_vllms_shape(server):
    assert set(httpx.get(f"{server}/version").json()) == {"version"}


# --- 8. error messages vLLM's clients match on ---------------------------------------------


def _error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_errors_use_vllms_words(server, model):
    post = lambda body: httpx.post(f"{server}/v1/completions", json={"model": model, **body})  # noqa: E731
    assert "Either prompt or prompt_embeds must be provided and non-empty." in _error(
        post({"prompt": ""})
    )
    assert "out of vocabulary" in _error(post({"prompt": [1, 2, 99_999_999]}))
    too_big = _error(post({"prompt": "hi", "seed": 2**64}))
    assert "seed" in too_big and "less_than_equal" in too_big
    assert "greater_than_equal" in _error(post({"prompt": "hi", "seed": -(2**64)}))
    keys = _error(post({"prompt": "hi", "logit_bias": {"a": 1, "b": 2, "3": 1}}))
    assert "'a'" in keys and "'b'" in keys
    vocab = _error(post({"prompt": "hi", "logit_bias": {"99999999": 1, "99999998": 1}}))
    assert "99999999" in vocab and "99999998" in vocab and "out-of-vocab" in vocab


def test_sagemaker_invocations_serve_chat_and_completions(server, model):
    chat = httpx.post(
        f"{server}/invocations", json={"model": model, "messages": USER, "max_tokens": 2}
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(
        f"{server}/invocations", json={"model": model, "prompt": "hi", "max_tokens": 2}
    )
    assert completion.status_code == 200
    assert completion.json()["object"] == "text_completion"
    neither = httpx.post(f"{server}/invocations", json={"model": model})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    unknown = httpx.post(f"{server}/invocations", json={"prompt": "hi", "no_such_field": 1})
    assert unknown.status_code == 400 and "no_such_field" in unknown.json()["error"]["message"]


def test_truncation_side_picks_the_end_that_is_kept(server, model, client):
    ids = client.completions.create(
        model=model, prompt="one two three four five six", max_tokens=1,
        extra_body={"return_token_ids": True},
    ).choices[0].model_extra["prompt_token_ids"]  # fmt: skip
    for side, kept in (("left", ids[-3:]), ("right", ids[:3])):
        out = client.completions.create(
            model=model, prompt="one two three four five six", max_tokens=1,
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 3,
                        "truncation_side": side},
        )  # fmt: skip
        assert out.choices[0].model_extra["prompt_token_ids"] == kept, side


def test_tokenize_returns_token_strings(server, model):
    response = httpx.post(
        f"{server}/tokenize",
        json={"model": model, "prompt": "hello world", "return_token_strs": True},
    )
    body = response.json()
    assert response.status_code == 200 and len(body["token_strs"]) == len(body["tokens"])
    assert all(isinstance(s, str) for s in body["token_strs"])
