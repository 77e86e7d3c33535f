"""Every vLLM metric with a meaning here is on ``/metrics`` under vLLM's name, type, labels
and buckets, with values that match the requests sent; vLLM's Grafana queries resolve.

vLLM's list is ``vllm_metrics.json`` (taken from vLLM's loggers; see its ``source``). A
metric of that list is either exported or named in ``docs/metrics.md``'s table of vLLM
metrics without a meaning here, never both and never neither.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.serve_process import serve, stop

HERE = Path(__file__).resolve().parent
VLLM = json.loads((HERE / "vllm_metrics.json").read_text())
DOCS = (HERE.parents[1] / "docs" / "metrics.md").read_text()
MAX_MODEL_LEN = 256
NUM_BLOCKS = 200
# Exported by vLLM only with speculative decoding, as here (tests/metrics/test_spec_decode_stats.py).
SPECULATIVE_ONLY = {
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
}

# Exported only with LoRA enabled (tests/server/test_lora_server.py checks it).
LORA_ONLY = {"vllm:lora_requests_info"}

pytestmark = pytest.mark.slow


def not_exported_in_docs() -> set[str]:
    section = DOCS[DOCS.index("## vLLM metrics not exported") :]
    return set(re.findall(r"^\| `(vllm:[a-z_]+)` \|", section, re.MULTILINE))


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's rule (``build_1_2_5_buckets``): 1, 2, 5, 10, ... up to max_model_len."""
    return [m * 10**e for e in range(10) for m in (1, 2, 5) if m * 10**e <= max_model_len]


class Scrape:
    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` with these label values."""
        found = [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert found, f"no sample {name} {labels}"
        return sum(found)

    def family(self, metric: str):
        """The metric's family if it has samples (a family without any exports nothing)."""
        # prometheus-client names a counter's family without its _total suffix.
        family = self.families.get(metric) or self.families.get(metric.removesuffix("_total"))
        return family if family is not None and family.samples else None


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """A server with vLLM's names, after: a completion, a streamed completion, an n=2
    completion and a streamed completion its client abandons."""
    log_path = tmp_path_factory.mktemp("vllm_metrics") / "server.log"
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--num-blocks-override", str(NUM_BLOCKS)]
    flags += ["--enable-sleep-mode"]
    proc, url = serve(tiny_llama, log_path, *flags, "--metrics-name-compat", "vllm")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        sent = {"max_tokens": [5, 4, 3, 3, 200], "prompt": ["one two three", "four five", "six"]}
        client.completions.create(
            model=model, prompt=sent["prompt"][0], max_tokens=5, extra_body={"ignore_eos": True}
        )
        stream = client.completions.create(
            model=model,
            prompt=sent["prompt"][1],
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert len([chunk for chunk in stream if chunk.choices]) >= 4
        client.completions.create(
            model=model,
            prompt=sent["prompt"][2],
            max_tokens=3,
            n=2,
            extra_body={"ignore_eos": True},
        )
        body = {"model": model, "prompt": "seven", "max_tokens": 200, "stream": True}
        body["ignore_eos"] = True
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # the client leaves after the first token: the server aborts
        deadline = time.monotonic() + 60
        while True:
            scrape = Scrape(httpx.get(f"{url}/metrics").text)
            aborted = scrape.value("vllm:request_success_total", finished_reason="abort")
            if aborted == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        yield scrape, model, url
    finally:
        stop(proc)


def test_the_docs_and_the_export_split_vllms_list(served):
    scrape, _, _ = served
    documented = not_exported_in_docs()
    names = {m["name"] for m in VLLM["metrics"]}
    assert documented <= names, f"docs name metrics vLLM does not have: {documented - names}"
    for metric in VLLM["metrics"]:
        name = metric["name"]
        exported = scrape.family(name) is not None
        if name in SPECULATIVE_ONLY | LORA_ONLY:
            assert not exported and name not in documented, name
        elif name in documented:
            assert not exported, f"{name} is exported but docs/metrics.md says it is not"
        else:
            assert exported, f"{name} is neither exported nor in docs/metrics.md's table"


def test_every_exported_vllm_metric_has_vllms_type_labels_and_buckets(served):
    scrape, _, _ = served
    checked = 0
    for metric in VLLM["metrics"]:
        family = scrape.family(metric["name"])
        if family is None:
            continue
        checked += 1
        assert family.type == metric["type"], metric["name"]
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        assert set(metric["labels"]) <= labels, (metric["name"], labels)
        if metric["name"] != "vllm:cache_config_info":  # vLLM's labels are its config's
            assert labels == set(metric["labels"]), (metric["name"], labels)
        if metric["type"] == "histogram":
            expected = metric["buckets"]
            if isinstance(expected, str):  # "1-2-5 series up to max_model_len"
                expected = request_tokens_buckets(MAX_MODEL_LEN)
            bounds = sorted(
                {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            )
            assert bounds == [*map(float, expected), float("inf")], metric["name"]
        twin = scrape.family("enginecore:" + metric["name"].removeprefix("vllm:"))
        assert twin is not None and twin.type == family.type, metric["name"]
    assert checked >= 30


def test_values_match_the_requests_sent(served):
    scrape, model, _ = served
    v = scrape.value
    samples, user_requests = 5, 4  # the n=2 request has two samples
    labels = {"model_name": model, "engine": "0"}
    assert v("vllm:request_success_total", finished_reason="length", **labels) == 4
    assert v("vllm:request_success_total", finished_reason="abort", **labels) == 1
    assert v("vllm:request_success_total", finished_reason="stop", **labels) == 0
    for histogram in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_prefill_kv_computed_tokens",
        "request_num_preemptions",
        "request_params_max_tokens",
    ):
        assert v(f"vllm:{histogram}_count", **labels) == samples, histogram
        assert v(f"enginecore:{histogram}_count", **labels) == samples, histogram
    # n and the longest sample: once per user request whose samples all finished.
    assert v("vllm:request_params_n_count", **labels) == user_requests - 1  # not the aborted
    assert v("vllm:request_params_n_sum", **labels) == 1 + 1 + 2
    assert v("vllm:request_max_num_generation_tokens_count", **labels) == user_requests - 1
    assert v("vllm:request_max_num_generation_tokens_sum", **labels) == 5 + 4 + 3
    assert v("vllm:request_params_max_tokens_sum", **labels) == 5 + 4 + 3 + 3 + 200
    # Tokens: the counters agree with the per-request histograms.
    generated = v("vllm:generation_tokens_total", **labels)
    assert generated == v("vllm:request_generation_tokens_sum", **labels)
    assert 5 + 4 + 3 + 3 + 1 <= generated < 5 + 4 + 3 + 3 + 200
    prompt = v("vllm:prompt_tokens_total", **labels)
    assert prompt == v("vllm:request_prompt_tokens_sum", **labels) > 0
    # One inter-token latency per output after each sample's first.
    assert v("vllm:inter_token_latency_seconds_count", **labels) == generated - samples
    assert v("vllm:iteration_tokens_total_count", **labels) > 0
    # vLLM's iteration tokens: each step's prompt tokens (of the requests whose prefill
    # ended in it) plus its generated tokens, so over a run the two counters' sum.
    assert v("vllm:iteration_tokens_total_sum", **labels) == prompt + generated
    computed = v("vllm:prompt_tokens_by_source_total", source="local_compute", **labels)
    hits = v("vllm:prompt_tokens_by_source_total", source="local_cache_hit", **labels)
    assert computed > 0 and hits == v("vllm:prefix_cache_hits_total", **labels)
    assert v("vllm:prompt_tokens_cached_total", **labels) == hits
    assert v("vllm:prompt_tokens_cached_by_source_total", source="device", **labels) == hits
    assert v("vllm:prefix_cache_queries_total", **labels) >= hits
    assert v("vllm:num_preemptions_total", **labels) == 0
    # Gauges and info.
    assert 0.0 <= v("vllm:kv_cache_usage_perc", **labels) <= 1.0
    assert v("vllm:num_requests_waiting_by_reason", reason="deferred", **labels) == 0
    assert v("vllm:engine_sleep_state", sleep_state="awake", **labels) == 1
    assert v("vllm:engine_sleep_state", sleep_state="discard_all", **labels) == 0
    assert v("vllm:admission_rejections_total", model_name=model) == 0
    info = v("vllm:cache_config_info", engine="0", num_gpu_blocks=str(NUM_BLOCKS))
    assert info == 1


def test_vllms_grafana_dashboard_queries_resolve(served):
    scrape, model, _ = served
    for series, labels in VLLM["grafana_series"].items():
        matching = [s for s in scrape.samples if s.name == series]
        assert matching, f"the dashboard's {series} is not exported"
        assert all(set(labels) <= set(s.labels) for s in matching), series
        assert {s.labels["model_name"] for s in matching} == {model}, series


def test_sleep_state_follows_sleep_and_wake_up(served):
    _, model, url = served
    labels = {"model_name": model, "engine": "0"}

    def states() -> tuple[float, ...]:
        scrape = Scrape(httpx.get(f"{url}/metrics").text)
        return tuple(
            scrape.value("vllm:engine_sleep_state", sleep_state=state, **labels)
            for state in ("awake", "weights_offloaded", "discard_all")
        )

    assert httpx.post(f"{url}/sleep", params={"level": 1}, timeout=60).status_code == 200
    assert states() == (0, 1, 0)
    assert httpx.post(f"{url}/wake_up", timeout=60).status_code == 200
    assert states() == (1, 0, 0)
