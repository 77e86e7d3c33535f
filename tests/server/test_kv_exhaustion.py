"""KV-cache exhaustion and preemption storms, against a real ``enginecore serve`` whose KV
cache holds 16 blocks (256 tokens): many long requests at once, each fitting alone but
not together. None is lost: every one finishes in full with the same greedy tokens as
when it ran alone (preempted requests are recomputed), the engine keeps serving, and
every block is free afterwards.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest

from tests.helpers.serve_process import serve, stop

NUM_BLOCKS = 16
PROMPT_TOKENS = 64
MAX_TOKENS = 64  # a request holds 8 of the 16 blocks by its end


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    log = tmp_path_factory.mktemp("kv-exhaustion") / "server.log"
    proc, url = serve(
        tiny_llama,
        log,
        *("--dtype", "float32", "--num-blocks-override", str(NUM_BLOCKS)),
        *("--block-size", "16", "--max-model-len", "256", "--no-prefix-caching"),
        env=env,
    )
    try:
        yield url
    finally:
        stop(proc)


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"enginecore:{name}"
    )


def _complete(url: str, prompt: list[int]) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "logprobs": 0,  # the sampled token ids come back as tokens: compared exactly
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def test_a_preemption_storm_loses_no_request_and_frees_every_block(server):
    prompts = [[5 + (11 * i + j) % 300 for j in range(PROMPT_TOKENS)] for i in range(6)]
    alone = [_complete(server, prompt) for prompt in prompts[:2]]
    preemptions_before = _metric(server, "num_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        storm = list(pool.map(lambda p: _complete(server, p), prompts))
    assert _metric(server, "num_preemptions_total") > preemptions_before, "no storm happened"
    for choice in storm:
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == MAX_TOKENS
    # Greedy tokens equal a lone run's, though the requests were preempted and recomputed.
    for lone, stormed in zip(alone, storm, strict=False):
        assert stormed["logprobs"]["tokens"] == lone["logprobs"]["tokens"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        _metric(server, "kv_cache_usage_perc") or _metric(server, "num_requests_running")
    ):
        time.sleep(0.2)
    assert _metric(server, "kv_cache_usage_perc") == 0, "blocks were left held"
    assert _metric(server, "num_requests_running") == 0
    assert _metric(server, "num_requests_waiting") == 0
    assert _complete(server, prompts[0])["logprobs"]["tokens"] == alone[0]["logprobs"]["tokens"]


def test_a_request_larger_than_the_whole_cache_gets_a_clear_error(server):
    answer = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": [5] * 300, "max_tokens": 8},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert "max_model_len" in answer.json()["error"]["message"]
    answer = httpx.post(
        f"{server}/v1/completions", json={"prompt": [5] * 8, "max_tokens": 4}, timeout=60
    )
    assert answer.status_code == 200, answer.text
