"""A prefill instance killed mid-transfer, behind ``enginecore disagg-proxy`` (real
processes, SIGKILL).

The decode server is frozen (SIGSTOP) while the proxy hands it a request whose prefill
has just finished, and the whole prefill server (frontend and engine core, where the KV
blocks wait) is SIGKILLed before the decode side fetched them. What the user sees: the
request fails within the decode's ``recv_timeout`` with an error naming the prefill
instance (``load_failure_policy = "fail"``), or the decode instance computes the prompt
itself and answers (``"recompute"``, as vLLM's policy of that name); nothing hangs (proxy, decode server); the decode side frees every KV block it
had allocated for the transfer (KV usage back to 0) and keeps serving. A request sent
after the loss gets the proxy's 502 naming the unreachable prefill instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from enginecore.testing.kv_connector_contract import free_port
from tests.helpers.serve_process import start_cli, stop, wait_healthy

pytestmark = pytest.mark.slow

COMMON = ["--dtype", "float32", "--max-model-len", "512", "--num-blocks-override", "200"]
PROMPT = "The history of the city begins with a small fishing village on the river bank"
# Shares no block with PROMPT (the decode side would find those in its prefix cache).
UNSEEN = (
    "In a distant galaxy, a lone explorer charted the stars one by one, writing each name "
    "into a worn leather notebook that her grandmother had given her before the voyage"
)


def metric(url: str, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def sigkill_tree(pid: int) -> None:
    """The server and everything it started (its engine core holds the KV blocks)."""
    procs = psutil.Process(pid).children(recursive=True)
    os.kill(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_mid_transfer(tiny_llama, tmp_path, policy) -> None:
    kv_port, p_port, d_port, proxy_port = (free_port() for _ in range(4))
    producer = ["--kv-role", "kv_producer", "--kv-connector-extra-config"]
    producer.append(json.dumps({"port": kv_port}))
    consumer = ["--kv-role", "kv_consumer", "--kv-connector-extra-config"]
    consumer.append(
        json.dumps(
            {"recv_timeout": 3, "load_failure_policy": policy, "peers": [f"127.0.0.1:{kv_port}"]}
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    urls = [f"http://127.0.0.1:{p}" for p in (p_port, d_port, proxy_port)]
    procs = []
    try:
        for port, kv, name in ((p_port, producer, "prefill"), (d_port, consumer, "decode")):
            args = ["serve", str(tiny_llama), "--port", str(port), *COMMON]
            args += ["--kv-connector", "zmq_p2p", *kv]
            procs.append(start_cli(args, tmp_path / f"{name}.log", env))
        proxy_args = ["disagg-proxy", "--port", str(proxy_port)]
        proxy_args += ["--prefill", urls[0], "--decode", urls[1]]
        procs.append(start_cli(proxy_args, tmp_path / "proxy.log", env))
        for proc, url, name in zip(procs, urls, ("prefill", "decode", "proxy"), strict=True):
            wait_healthy(url, proc, tmp_path / f"{name}.log")
        prefill, decode, _ = procs
        prefill_url, decode_url, proxy_url = urls
        client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        # The path works before the fault.
        ok = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason == "length"
        prefilled = metric(prefill_url, "enginecore:generation_tokens_total")

        decode.send_signal(signal.SIGSTOP)
        outcome: dict[str, object] = {}

        def ask() -> None:
            try:
                outcome["answer"] = client.completions.create(
                    model=model, prompt=UNSEEN, max_tokens=4, temperature=0
                )
            except openai.APIStatusError as exc:
                outcome["error"] = exc

        asking = threading.Thread(target=ask)
        asking.start()
        deadline = time.monotonic() + 120
        while metric(prefill_url, "enginecore:generation_tokens_total") <= prefilled:
            assert time.monotonic() < deadline, "the prefill instance never answered"
            time.sleep(0.2)
        time.sleep(1.0)  # its answer reaches the proxy, which hands it to the frozen decode
        sigkill_tree(prefill.pid)
        killed_at = time.monotonic()
        decode.send_signal(signal.SIGCONT)
        asking.join(90)
        assert not asking.is_alive(), "the client hung on the proxy"
        failed_after = time.monotonic() - killed_at
        assert failed_after < 60
        if policy == "fail":
            error = outcome.get("error")
            assert isinstance(error, openai.APIStatusError), outcome
            assert error.status_code == 502, error  # the prefill instance failed
            assert "no answer from the prefill instance" in str(error), error
        else:
            answer = outcome.get("answer")
            assert answer is not None, outcome
            direct = openai.OpenAI(base_url=f"{decode_url}/v1", api_key="unused", max_retries=0)
            local = direct.completions.create(
                model=model, prompt=UNSEEN, max_tokens=4, temperature=0
            )
            assert answer.choices[0].text == local.choices[0].text
            assert "recomputing" in (tmp_path / "decode.log").read_text()

        deadline = time.monotonic() + 30
        while metric(decode_url, "enginecore:kv_cache_usage_perc") != 0.0:
            assert time.monotonic() < deadline, "KV blocks of the failed transfer leaked"
            time.sleep(0.2)
        direct = openai.OpenAI(base_url=f"{decode_url}/v1", api_key="unused", max_retries=0)
        served = direct.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert served.choices[0].finish_reason == "length"
        with pytest.raises(openai.APIStatusError, match="prefill instance") as lost:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert lost.value.status_code == 502
        assert httpx.get(f"{proxy_url}/health", timeout=10).status_code == 503
        print(f"prefill killed mid-transfer ({policy}): answered {failed_after:.1f} s later")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                stop(proc)
