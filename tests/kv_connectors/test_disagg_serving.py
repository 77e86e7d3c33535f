"""Disaggregated serving over loopback: a prefill server, a decode server and
``enginecore disagg-proxy`` in front, driven by the real ``openai`` client. Greedy
answers equal a single engine's, streamed or not; the KV really moved (the decode
server's stats show loaded, not computed, prompt tokens)."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import openai
import pytest

from enginecore import LLM, SamplingParams
from enginecore.testing.kv_connector_contract import free_port
from tests.helpers.serve_process import start_cli, wait_healthy

pytestmark = pytest.mark.slow

COMMON = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks-override", "200"]


@pytest.fixture(scope="module")
def disagg(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    kv_port, p_port, d_port, proxy_port = (free_port() for _ in range(4))
    producer = ["--kv-role", "kv_producer", "--kv-connector-extra-config"]
    producer.append(json.dumps({"port": kv_port}))
    consumer = ["--kv-role", "kv_consumer", "--kv-connector-extra-config"]
    consumer.append(json.dumps({"peers": [f"127.0.0.1:{kv_port}"]}))
    decode_stats = tmp / "decode-stats.jsonl"
    prefill_env = dict(os.environ, ENGINECORE_JSONL_STATS_PATH=str(tmp / "prefill.jsonl"))
    decode_env = dict(os.environ, ENGINECORE_JSONL_STATS_PATH=str(decode_stats))
    procs = []
    try:
        for port, kv, log, proc_env in (
            (p_port, producer, tmp / "prefill.log", prefill_env),
            (d_port, consumer, tmp / "decode.log", decode_env),
        ):
            args = ["serve", str(tiny_llama), "--port", str(port), *COMMON]
            args += ["--kv-connector", "zmq_p2p", *kv, "--stat-loggers", "jsonl"]
            procs.append((start_cli(args, log, proc_env), f"http://127.0.0.1:{port}", log))
        proxy_args = ["disagg-proxy", "--port", str(proxy_port)]
        proxy_args += ["--prefill", procs[0][1], "--decode", procs[1][1]]
        procs.append(
            (
                start_cli(proxy_args, tmp / "proxy.log"),
                f"http://127.0.0.1:{proxy_port}",
                tmp / "proxy.log",
            )
        )
        for proc, url, log in procs:
            wait_healthy(url, proc, log)
        yield {"proxy": procs[2][1], "decode_stats": decode_stats}
    finally:
        for proc, _, _ in reversed(procs):
            proc.send_signal(2)
        for proc, _, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


PROMPTS = [
    "The history of the city begins with a small fishing village on the river bank",
    "In a distant galaxy, a lone explorer charted the stars one by one, writing each name",
]


def test_proxy_answers_like_a_single_engine(disagg, tiny_llama):
    client = openai.OpenAI(base_url=disagg["proxy"] + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    with LLM(str(tiny_llama), dtype="float32", max_model_len=512, multiprocessing=False) as llm:
        expected = [
            o.outputs[0].text
            for o in llm.generate(
                PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        ]
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    # The decode server loaded each prompt's full blocks instead of computing them (the
    # second request of a prompt hits its own prefix cache instead).
    lines = [json.loads(x) for x in disagg["decode_stats"].read_text().splitlines() if x]
    loaded = sum(line["scheduler"]["num_kv_loaded_tokens"] for line in lines if line["scheduler"])
    assert loaded >= 16 * len(PROMPTS)


def test_proxy_passes_errors_through(disagg):
    answer = httpx.post(disagg["proxy"] + "/v1/completions", content=b"{not json", timeout=30)
    assert answer.status_code == 400
    assert "not valid JSON" in answer.json()["error"]["message"]
