"""``enginecore serve --data-parallel-size 2`` with the real ``openai`` client.

Requests are balanced over both replicas or pinned to one by the body field
``data_parallel_rank`` or the ``X-data-parallel-rank`` header; ``/metrics`` carries
every series once per engine (label ``engine``).
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from tests.helpers.serve_process import serve, stop
from tests.helpers.stats import generation_tokens_by_engine


@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("dp-server") / "server.log"
    flags = ["--max-model-len", "512", "--num-blocks-override", "128"]
    flags += ["--data-parallel-size", "2"]
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    proc, url = serve(tiny_llama, log_path, *flags, env=env)
    try:
        yield url, log_path
    finally:
        stop(proc)


def test_serve_dp2_balances_pins_and_reports_per_engine(dp_server) -> None:
    url, log_path = dp_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert "data_parallel=2 replicas (mp, internal load balancing)" in log_path.read_text()
    assert generation_tokens_by_engine(url) == {"0": 0.0, "1": 0.0}

    # Pinned by the body field, then by the header: only that engine's series grows.
    pinned = client.completions.create(
        model=model, prompt="hello there", max_tokens=5, temperature=0.0,
        extra_body={"data_parallel_rank": 1, "ignore_eos": True},
    )  # fmt: skip
    assert pinned.usage.completion_tokens == 5
    assert generation_tokens_by_engine(url) == {"0": 0.0, "1": 5.0}
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0.0, extra_body={"ignore_eos": True},
        extra_headers={"X-data-parallel-rank": "0"},
    )  # fmt: skip
    assert chat.usage.completion_tokens == 4
    assert generation_tokens_by_engine(url) == {"0": 4.0, "1": 5.0}
    # Greedy output does not depend on the replica.
    again = client.completions.create(
        model=model, prompt="hello there", max_tokens=5, temperature=0.0,
        extra_body={"data_parallel_rank": 0, "ignore_eos": True},
    )  # fmt: skip
    assert again.choices[0].text == pinned.choices[0].text

    # A batch of prompts without a rank spreads over both replicas.
    before = generation_tokens_by_engine(url)
    batch = client.completions.create(
        model=model, prompt=[f"prompt number {i}" for i in range(6)], max_tokens=3,
        temperature=0.0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert batch.usage.completion_tokens == 18
    after = generation_tokens_by_engine(url)
    grown = {e: after[e] - before[e] for e in after}
    assert grown["0"] > 0 and grown["1"] > 0 and sum(grown.values()) == 18


def test_serve_dp2_rejects_bad_ranks(dp_server) -> None:
    url, _ = dp_server
    body = {"prompt": "x", "max_tokens": 2}
    for extra, headers in (
        ({"data_parallel_rank": 2}, {}),
        ({}, {"X-data-parallel-rank": "7"}),
        ({}, {"X-data-parallel-rank": "one"}),
    ):
        response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, headers=headers)
        assert response.status_code == 400, response.text
        assert "data-parallel-rank" in response.text.lower().replace("_", "-")
    assert httpx.get(f"{url}/health").status_code == 200
