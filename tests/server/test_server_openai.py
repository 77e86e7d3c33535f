"""The OpenAI-compatible server, end to end: a real ``enginecore serve`` subprocess on
loopback, driven by the real ``openai`` client (and httpx for what the client hides).

One server serves the whole module: tiny random Llama, an API key, and the ``jsonl``
stat-logger plugin writing to a temp file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.plugin_install import install_to_target, with_on_path
from tests.helpers.serve_process import API_KEY, Server, serve, stop

MAX_MODEL_LEN = 2048
JSONL_PLUGIN = Path(__file__).parents[2] / "plugins" / "enginecore-jsonl-stats"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    stats_path = tmp / "stats.jsonl"
    log_path = tmp / "server.log"
    env = dict(os.environ)
    env.update(ENGINECORE_JSONL_STATS_PATH=str(stats_path), ENGINECORE_API_KEY=API_KEY)
    # The server finds the plugin as a user's pip install makes it findable, whatever this
    # venv holds (the example packages are installed into it only by their own tests).
    with_on_path(env, install_to_target(JSONL_PLUGIN, tmp / "jsonl-plugin"))
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--num-blocks-override", "400"]
    flags += ["--stat-loggers", "logging,jsonl", "--enable-sleep-mode", "--enable-dev-endpoints"]
    proc, url = serve(tiny_llama, log_path, *flags, env=env)
    srv = Server(url, proc, stats_path, log_path)
    yield srv
    srv.http.close()
    stop(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def tokenize(server, **body) -> list[int]:
    response = server.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# --- start-up ---------------------------------------------------------------------------------


def test_startup_log_lists_the_resolved_components(server):
    log = server.log_path.read_text()
    assert "components:" in log
    for part in ("scheduler=default", "executor=mp", "model_runner=torch", "jsonl (from"):
        assert part in log, log


def test_models_health_version(server, client, model, tiny_llama):
    assert model == str(tiny_llama)
    assert client.models.list().data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert "version" in httpx.get(f"{server.url}/version").json()


# --- completions ----------------------------------------------------------------------------


def test_completion_and_usage_counts(server, client, model):
    prompt = "The quick brown fox"
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len(tokenize(server, prompt=prompt))
    assert out.usage.completion_tokens == 12 == len(choice.logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert "".join(choice.logprobs.tokens) == choice.text


def test_completion_streaming_matches_non_streaming(client, model):
    kw = dict(model=model, prompt="Stream me", max_tokens=16, temperature=0)
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and not chunks[-1].choices
    assert usage_chunks[0].usage.completion_tokens == 16
    assert usage_chunks[0].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_2_and_seed_reproducibility(client, model):
    kw = dict(model=model, prompt="Sample twice", max_tokens=10, temperature=1.0, n=2, seed=123)
    a = client.completions.create(**kw, extra_body={"ignore_eos": True})
    b = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20
    c = client.completions.create(**{**kw, "seed": 321}, extra_body={"ignore_eos": True})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_stop_strings_streaming_and_not(client, model):
    kw = dict(model=model, prompt="Stop somewhere", max_tokens=24, temperature=0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    expected = full[: full.index(stop)]
    out = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_echo_and_multiple_prompts(client, model):
    out = client.completions.create(
        model=model, prompt=["First prompt", "Second"], max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("First prompt")
    assert out.choices[1].text.startswith("Second")


def test_completion_logprobs_shape(client, model):
    out = client.completions.create(
        model=model, prompt="Logprobs", max_tokens=5, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    # Greedy: the sampled token is the most likely one.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert token in top


# --- chat ---------------------------------------------------------------------------------------


def test_chat_non_streaming_and_streaming(server, client, model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tokenize(server, messages=messages))
    assert whole.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_logprobs_and_n(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        logprobs=True, top_logprobs=2, seed=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        assert all(len(item.top_logprobs) == 2 for item in content)
        assert all(item.bytes == list(item.token.encode()) for item in content)


# --- errors and security ------------------------------------------------------------------------


def _assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
        ("/v1/completions", {"prompt": "x", "temperature": -1}),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"not-a-token": 1}}),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}),
        ("/v1/completions", {"prompt": []}),
        ("/v1/chat/completions", {"messages": "hello"}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ],
)
def test_wrong_types_and_values_are_400(server, path, body):
    _assert_error(server.post(path, json=body), 400)


def test_malformed_json_is_400(server):
    response = server.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    _assert_error(response, 400)


def test_openai_client_sees_bad_request_errors(client, model):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=model, prompt="word " * (MAX_MODEL_LEN + 10))
    with pytest.raises(openai.BadRequestError, match="n must be at most"):
        client.completions.create(model=model, prompt="x", n=1000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logprobs must be at most"):
        client.completions.create(model=model, prompt="x", logprobs=100, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x" * 20000}]
        )


def test_embeddings_on_a_generation_model_is_a_400(client, model):
    for create in (
        lambda: client.embeddings.create(model=model, input="hello"),
        lambda: client.post("/score", cast_to=object, body={"text_1": "a", "text_2": "b"}),
    ):
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            create()
    # Generation is unaffected.
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices


def test_api_key_is_required_on_v1_and_control_routes(server, model):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        _assert_error(r, 401)
        _assert_error(httpx.post(f"{server.url}/sleep", headers=headers), 401)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_body_size_limit(server):
    response = server.post("/v1/completions", json={"prompt": "x" * (5 * 1024 * 1024)})
    _assert_error(response, 413)


def test_collective_rpc_is_off_by_default(server):
    response = server.post("/collective_rpc", json={"method": "get_pid"})
    assert response.status_code == 404


# --- other endpoints ---------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server):
    tokens = tokenize(server, prompt="Hello tokenizer world")
    assert tokens
    response = server.post("/detokenize", json={"tokens": tokens})
    assert response.json()["prompt"] == "Hello tokenizer world"
    _assert_error(server.post("/detokenize", json={"tokens": [10**9]}), 400)


def test_sleep_wake_pause_resume(server, client, model):
    assert server.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    assert server.post("/wake_up").json()["status"] == "awake"
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.completions.create(model=model, prompt="awake", max_tokens=2).choices
    assert server.post("/pause", params={"mode": "wait"}).json()["status"] == "paused"
    assert server.get("/is_paused").json() == {"is_paused": True}
    _assert_error(server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
    assert server.post("/resume").json() == {"status": "resumed"}
    assert client.completions.create(model=model, prompt="resumed", max_tokens=2).choices
    _assert_error(server.post("/pause", params={"mode": "bogus"}), 400)


def test_metrics_content(server, client, model):
    client.completions.create(model=model, prompt="metrics", max_tokens=3)
    values = server.metrics()
    for name in (
        "enginecore:num_requests_running",
        "enginecore:num_requests_waiting",
        "enginecore:kv_cache_usage_perc",
        "enginecore:prompt_tokens_total",
        "enginecore:generation_tokens_total",
        "enginecore:prefix_cache_queries_total",
        "enginecore:time_to_first_token_seconds_count",
        "enginecore:inter_token_latency_seconds_count",
        "enginecore:e2e_request_latency_seconds_count",
        "enginecore:request_queue_time_seconds_count",
    ):
        assert name in values, sorted(values)
    assert values["enginecore:generation_tokens_total"] >= 3
    assert values["enginecore:request_success_total[length]"] >= 1


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, client, model):
    body = {"prompt": "a long story", "max_tokens": MAX_MODEL_LEN - 100, "stream": True}
    body["ignore_eos"] = True
    request_id = None
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                request_id = json.loads(line[6:])["id"]
                break
    assert request_id
    deadline = time.monotonic() + 20
    while request_id not in server.finished_records() and time.monotonic() < deadline:
        time.sleep(0.1)
    record = server.finished_records()[request_id]
    assert record["finish_reason"] == "abort"
    assert record["num_generation_tokens"] < MAX_MODEL_LEN - 100
    # Every block is back in the pool: the next step's stats show an empty cache.
    client.completions.create(model=model, prompt="after", max_tokens=2)
    values = server.metrics()
    assert values["enginecore:kv_cache_usage_perc"] == 0.0
    assert values["enginecore:num_requests_running"] == 0.0


def test_client_disconnect_while_waiting_for_a_whole_response_aborts(server):
    body = {"prompt": "never read", "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True}
    body["user"] = "gone-before-the-answer"
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 20
    record = None
    while record is None and time.monotonic() < deadline:
        time.sleep(0.1)
        records = server.finished_records().values()
        record = next((r for r in records if (r["extra"] or {}).get("user") == body["user"]), None)
    assert record is not None and record["finish_reason"] == "abort"
    assert record["num_generation_tokens"] < MAX_MODEL_LEN - 100


def test_jsonl_plugin_end_to_end(server, client, model):
    out = client.completions.create(
        model=model, prompt="jsonl", max_tokens=4, user="alice",
        extra_body={"metadata": {"team": "search"}, "ignore_eos": True},
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while out.id not in server.finished_records() and time.monotonic() < deadline:
        time.sleep(0.1)
    record = server.finished_records()[out.id]
    # ``client``: the address the server puts there for the per-client share of a step.
    assert record["extra"] == {"team": "search", "user": "alice", "client": "127.0.0.1"}
    assert record["finish_reason"] == "length" and record["num_generation_tokens"] == 4
    lines = server.stats_lines()
    steps = [line["scheduler"]["step_counter"] for line in lines if line["scheduler"]]
    assert steps and steps == sorted(steps)
    # One line per step: the plugin saw every token the Prometheus logger counted.
    tokens = sum(line["iteration"]["num_generation_tokens"] for line in lines if line["iteration"])
    assert tokens == server.metrics()["enginecore:generation_tokens_total"]


# --- the serving benchmark ----------------------------------------------------------------------


def test_bench_serve_against_the_server(server, tmp_path):
    from enginecore.cli import main

    result_file = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY]
    argv += ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--no-progress"]
    argv += ["--request-rate", "50,inf", "--result-file", str(result_file), "--plot", str(plot)]
    assert main(argv) == 0
    results = json.loads(result_file.read_text())
    assert [r["request_rate"] for r in results] == [50.0, "inf"]
    # Each rate gets its own prompts, so a prefix-caching server cannot answer the second
    # rate from the first one's cache.
    assert [r["seed"] for r in results] == [0, 1]
    for r in results:
        assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 16
        assert r["p50_ttft_ms"] > 0 and r["p99_itl_ms"] >= r["p50_itl_ms"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- prompt logprobs and echo ---------------------------------------------------------------


def _reference_prompt_logprobs(path, ids):
    import torch

    from tests.helpers.hf_reference import load_reference

    with torch.inference_mode():
        logits = load_reference(str(path))(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_echo_with_logprobs_returns_prompt_logprobs(server, client, model, tiny_llama):
    prompt = "Prompt logprobs through the server"
    ids = tokenize(server, prompt=prompt, add_special_tokens=False)
    kw = dict(model=model, prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    out = client.completions.create(**kw, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 3
    assert "".join(lp.tokens[: len(ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    want = _reference_prompt_logprobs(tiny_llama, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        # The top 2, and the prompt's own token when it is not among them (as OpenAI's).
        top_ids = want[i - 1].topk(2).indices.tolist()
        shown = top_ids if ids[i] in top_ids else [*top_ids, ids[i]]
        top = sorted((float(want[i - 1, t]) for t in shown), reverse=True)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-4)
    assert lp.text_offset[: len(ids)] == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert lp.text_offset[len(ids)] == len(prompt)
    # Streaming: the first chunk carries the prompt and its logprobs.
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    streamed = [
        value
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for value in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_prompt_logprobs_extension_and_bounds(server, client, model):
    out = server.post(
        "/v1/completions",
        json={"model": model, "prompt": "abc def", "max_tokens": 1, "prompt_logprobs": 20},
    )
    assert out.status_code == 200, out.text
    ids = tokenize(server, prompt="abc def", add_special_tokens=False)
    (choice,) = out.json()["choices"]
    assert choice["logprobs"] is None  # no echo: the OpenAI field stays as asked
    raw = choice["prompt_logprobs"]  # vLLM's field: {token id: {logprob, rank, decoded_token}}
    assert len(raw) == len(ids) and raw[0] is None
    for token, entry in zip(ids[1:], raw[1:], strict=True):
        assert str(token) in entry and len(entry) in (20, 21)
        assert all(v["logprob"] <= 0 for v in entry.values())
    for path, body in [
        ("/v1/completions", {"prompt": "abc"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
    ]:
        too_many = server.post(
            path, json={"model": model, "max_tokens": 1, "prompt_logprobs": 21, **body}
        )
        assert too_many.status_code == 400 and "prompt_logprobs" in too_many.text
    messages = [{"role": "user", "content": "abc def"}]
    chat = server.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    chat_ids = tokenize(server, messages=messages)
    raw = chat.json()["prompt_logprobs"]
    assert len(raw) == len(chat_ids) and raw[0] is None
    assert all(list(entry) == [str(t)] for t, entry in zip(chat_ids[1:], raw[1:], strict=True))


def test_chat_echo_continues_an_assistant_turn(client, model):
    messages = [
        {"role": "user", "content": "Say something"},
        {"role": "assistant", "content": "Partial answer:"},
    ]
    kw = dict(model=model, messages=messages, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False})
    echoed = client.chat.completions.create(
        **kw, extra_body={"add_generation_prompt": False, "echo": True}
    )
    assert echoed.choices[0].message.content == "Partial answer:" + plain.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, extra_body={"add_generation_prompt": False, "echo": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == echoed.choices[0].message.content
