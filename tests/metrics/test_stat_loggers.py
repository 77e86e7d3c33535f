"""The built-in stat loggers, fed real SchedulerStats / IterationStats objects."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from enginecore import make_config
from enginecore.interfaces import IterationStats, StatLogger
from enginecore.metrics.stats import FinishedRequestStats
from enginecore.plugins import make_plugin_manager
from enginecore.protocol import SchedulerStats
from enginecore.request import FinishReason
from enginecore_stat_loggers.logging_logger import LoggingStatLogger
from enginecore_stat_loggers.prometheus_logger import PrometheusStatLogger
from tests.helpers.stats import FakeClock, exposition, sample


def finished(request_id: str, reason=FinishReason.STOP, **overrides) -> FinishedRequestStats:
    values = dict(
        request_id=request_id,
        finish_reason=reason,
        num_prompt_tokens=10,
        num_generation_tokens=4,
        e2e_latency=1.2,
        queued_time=0.2,
        prefill_time=0.1,
        ttft=0.3,
        mean_tpot=0.3,
        num_cached_tokens=8,
    )
    values.update(overrides)
    return FinishedRequestStats(**values)


# --- FinishedRequestStats ---------------------------------------------------------------


def test_finished_request_stats_is_plain_json_ready_data():
    stats = finished("r1", FinishReason.LENGTH, extra={"user": "alice", "tags": ["a"]})
    assert stats.finish_reason == "length"  # the enum is converted to its API name
    data = stats.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["request_id"] == "r1" and data["extra"] == {"user": "alice", "tags": ["a"]}
    assert set(data) == {
        "request_id",
        "finish_reason",
        "num_prompt_tokens",
        "num_generation_tokens",
        "e2e_latency",
        "queued_time",
        "prefill_time",
        "inference_time",
        "decode_time",
        "ttft",
        "mean_tpot",
        "num_cached_tokens",
        "num_preemptions",
        "max_tokens_param",
        "extra",
    }


# --- registration -----------------------------------------------------------------------


def test_builtin_loggers_are_registered_lazily():
    host = make_plugin_manager(
        load_entrypoints=False, builtins={"builtin_stat_loggers": "enginecore_stat_loggers.plugin"}
    )
    registry = host.registry("stat_logger")
    assert registry.entry("logging").factory == (
        "enginecore_stat_loggers.logging_logger:LoggingStatLogger"
    )
    assert registry.entry("prometheus").factory == (
        "enginecore_stat_loggers.prometheus_logger:PrometheusStatLogger"
    )
    assert all(registry.entry(n).summary for n in registry)
    for name, cls in (("logging", LoggingStatLogger), ("prometheus", PrometheusStatLogger)):
        assert registry.get(name) is cls and issubclass(cls, StatLogger)


# --- logging ----------------------------------------------------------------------------


@pytest.fixture
def logging_logger():
    clock = FakeClock()
    logger = LoggingStatLogger(make_config(log_stats_interval=5.0), 2, clock=clock)
    return logger, clock


def test_logging_logger_line_averages_over_the_interval(logging_logger, caplog):
    logger, clock = logging_logger
    caplog.set_level(logging.INFO, logger="enginecore.metrics")
    logger.record(
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=5,
            kv_cache_usage=0.1,
            prefix_cache_queries=100,
            prefix_cache_hits=20,
        ),
        IterationStats(num_prompt_tokens=400, num_generation_tokens=2),
    )
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=60,
        ),
        IterationStats(num_prompt_tokens=100, num_generation_tokens=18),
    )
    clock.now += 10.0
    logger.log()
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "Engine 002: Avg prompt throughput: 50.0 tokens/s, "
        "Avg generation throughput: 2.0 tokens/s, Running: 3 reqs, Waiting: 2 reqs, "
        "KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )


def test_logging_logger_resets_each_interval_and_goes_quiet_when_idle(logging_logger, caplog):
    logger, clock = logging_logger
    caplog.set_level(logging.DEBUG, logger="enginecore.metrics")
    logger.record(
        SchedulerStats(num_running_reqs=1, num_preemptions=2),
        IterationStats(num_generation_tokens=30),
    )
    clock.now += 3.0
    logger.log()
    assert "Avg generation throughput: 10.0 tokens/s" in caplog.records[-1].getMessage()
    assert "Preemptions: 2" in caplog.records[-1].getMessage()

    # Next interval: the engine drained; nothing ran.
    logger.record(SchedulerStats(num_running_reqs=0), IterationStats())
    clock.now += 5.0
    logger.log()
    last = caplog.records[-1]
    assert last.levelno == logging.DEBUG
    assert "Avg prompt throughput: 0.0 tokens/s" in last.getMessage()
    assert "Avg generation throughput: 0.0 tokens/s" in last.getMessage()
    assert "Prefix cache hit rate: 0.0%" in last.getMessage()
    assert "Preemptions" not in last.getMessage()


def test_logging_logger_counts_finished_requests_and_accepts_missing_stats(logging_logger):
    logger, _ = logging_logger
    logger.record(None, IterationStats(finished_requests=[finished("a"), finished("b")]))
    logger.record(SchedulerStats(num_waiting_reqs=1), None)
    assert logger.num_finished_requests == 2
    assert "Waiting: 1 reqs" in logger.format_line()


def test_logging_logger_announces_itself(logging_logger, caplog):
    logger, _ = logging_logger
    caplog.set_level(logging.INFO, logger="enginecore.metrics")
    logger.log_engine_initialized()
    assert "Engine 002: logging stats every 5.0 s" in caplog.text


# --- prometheus -------------------------------------------------------------------------


@pytest.fixture
def prom():
    registry = CollectorRegistry()
    config = make_config(model="/models/tiny", served_model_name="tiny")
    return PrometheusStatLogger(config, 0, registry=registry), registry


def test_prometheus_series_exist_before_the_first_step(prom):
    _, registry = prom
    text = exposition(registry)
    assert 'enginecore:num_requests_running{engine="0",model_name="tiny"} 0.0' in text
    assert 'enginecore:prompt_tokens_total{engine="0",model_name="tiny"} 0.0' in text


def test_prometheus_gauges_and_counters(prom):
    logger, registry = prom
    logger.record(
        SchedulerStats(
            num_running_reqs=4,
            num_waiting_reqs=1,
            kv_cache_usage=0.5,
            prefix_cache_queries=64,
            prefix_cache_hits=48,
            num_preemptions=1,
        ),
        IterationStats(num_prompt_tokens=300, num_generation_tokens=4),
    )
    logger.record(
        SchedulerStats(num_running_reqs=3, kv_cache_usage=0.375, prefix_cache_queries=16),
        IterationStats(num_generation_tokens=3),
    )
    text = exposition(registry)
    labels = '{engine="0",model_name="tiny"}'
    assert f"enginecore:num_requests_running{labels} 3.0" in text
    assert f"enginecore:num_requests_waiting{labels} 0.0" in text
    assert f"enginecore:kv_cache_usage_perc{labels} 0.375" in text
    assert f"enginecore:prompt_tokens_total{labels} 300.0" in text
    assert f"enginecore:generation_tokens_total{labels} 7.0" in text
    assert f"enginecore:prefix_cache_queries_total{labels} 80.0" in text
    assert f"enginecore:prefix_cache_hits_total{labels} 48.0" in text
    assert f"enginecore:num_preemptions_total{labels} 1.0" in text
    assert "# TYPE enginecore:prompt_tokens_total counter" in text
    assert "# TYPE enginecore:kv_cache_usage_perc gauge" in text


def test_prometheus_histograms_and_finished_requests(prom):
    logger, registry = prom
    logger.record(
        None,
        IterationStats(
            time_to_first_tokens=[0.03, 0.7],
            inter_token_latencies=[0.02, 0.02, 0.04],
            finished_requests=[
                finished("a", FinishReason.STOP, e2e_latency=1.2, queued_time=0.2),
                finished("b", FinishReason.LENGTH, e2e_latency=3.0, queued_time=0.0),
                finished("c", FinishReason.STOP, e2e_latency=0.6, queued_time=0.1),
            ],
        ),
    )
    labels = {"engine": "0", "model_name": "tiny"}
    assert sample(registry, "enginecore:request_success_total", finished_reason="stop") == 2
    assert sample(registry, "enginecore:request_success_total", finished_reason="length") == 1
    ttft = "enginecore:time_to_first_token_seconds"
    assert sample(registry, f"{ttft}_count", **labels) == 2
    assert sample(registry, f"{ttft}_sum", **labels) == pytest.approx(0.73)
    assert sample(registry, f"{ttft}_bucket", le="0.04", **labels) == 1
    assert sample(registry, f"{ttft}_bucket", le="+Inf", **labels) == 2
    itl = "enginecore:inter_token_latency_seconds"
    assert sample(registry, f"{itl}_count", **labels) == 3
    assert sample(registry, f"{itl}_sum", **labels) == pytest.approx(0.08)
    e2e = "enginecore:e2e_request_latency_seconds"
    assert sample(registry, f"{e2e}_count", **labels) == 3
    assert sample(registry, f"{e2e}_sum", **labels) == pytest.approx(4.8)
    queue = "enginecore:request_queue_time_seconds"
    assert sample(registry, f"{queue}_sum", **labels) == pytest.approx(0.3)
    text = exposition(registry)
    assert (
        'enginecore:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0'
        in text
    )


def test_prometheus_loggers_with_their_own_registries_are_independent():
    first, second = CollectorRegistry(), CollectorRegistry()
    config = make_config(model="m")
    PrometheusStatLogger(config, registry=first).record(None, IterationStats(num_prompt_tokens=5))
    PrometheusStatLogger(config, registry=second).record(None, IterationStats(num_prompt_tokens=7))
    assert sample(first, "enginecore:prompt_tokens_total", model_name="m") == 5
    assert sample(second, "enginecore:prompt_tokens_total", model_name="m") == 7


def test_prometheus_loggers_share_one_registry_under_their_own_labels():
    registry = CollectorRegistry()
    config = make_config(model="m")
    engine0 = PrometheusStatLogger(config, 0, registry=registry)
    engine1 = PrometheusStatLogger(config, 1, registry=registry)  # no duplicate-series error
    engine0.record(SchedulerStats(num_running_reqs=2), IterationStats(num_prompt_tokens=3))
    engine1.record(SchedulerStats(num_running_reqs=5), IterationStats(num_prompt_tokens=4))
    # A logger shared by several engines is told the index per call.
    engine0.record(SchedulerStats(num_running_reqs=6), None, engine_index=1)
    assert sample(registry, "enginecore:num_requests_running", engine="0") == 2
    assert sample(registry, "enginecore:num_requests_running", engine="1") == 6
    assert sample(registry, "enginecore:prompt_tokens_total", engine="0") == 3
    assert sample(registry, "enginecore:prompt_tokens_total", engine="1") == 4


def test_prometheus_model_name_falls_back_to_the_checkpoint_path():
    registry = CollectorRegistry()
    PrometheusStatLogger(make_config(model="/ckpt/llama"), registry=registry)
    assert sample(registry, "enginecore:num_requests_running", model_name="/ckpt/llama") == 0


def test_prometheus_metrics_under_vllm_names_with_the_compat_setting():
    registry = CollectorRegistry()
    config = make_config(model="m", metrics_name_compat="vllm")
    logger = PrometheusStatLogger(config, registry=registry)
    logger.record(
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25),
        IterationStats(
            num_prompt_tokens=9,
            num_generation_tokens=4,
            time_to_first_tokens=[0.03],
            inter_token_latencies=[0.02],
            finished_requests=[finished("a", FinishReason.STOP, e2e_latency=1.0)],
        ),
    )
    ours = {}
    for family in text_string_to_metric_families(exposition(registry)):
        for s in family.samples:
            ours[(s.name, tuple(sorted(s.labels.items())))] = s.value
    # Histogram buckets differ (enginecore's reach lower, vLLM's are vLLM's); every other
    # sample (counts, sums, counters, gauges) has its vllm: twin.
    enginecore = {
        k: v
        for k, v in ours.items()
        if k[0].startswith("enginecore:") and not k[0].endswith(("_created", "_bucket"))
    }
    assert enginecore
    for (name, labels), value in enginecore.items():
        twin = ("vllm:" + name.removeprefix("enginecore:"), labels)
        assert ours.get(twin) == value, twin
    # What vLLM's Grafana dashboard queries.
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert any(n == name for n, _ in ours), name
    plain = CollectorRegistry()
    PrometheusStatLogger(make_config(model="m"), registry=plain)
    assert "vllm:" not in exposition(plain)


def test_prometheus_sleep_state_and_admission_rejections():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(make_config(model="m"), registry=registry)
    state = {"engine": "0", "model_name": "m"}

    def sleep_states() -> tuple[float, ...]:
        return tuple(
            sample(registry, "enginecore:engine_sleep_state", sleep_state=s, **state)
            for s in ("awake", "weights_offloaded", "discard_all")
        )

    assert sleep_states() == (1, 0, 0)
    logger.record_sleep_state(True, 1)
    assert sleep_states() == (0, 1, 0)
    logger.record_sleep_state(True, 2)
    assert sleep_states() == (0, 0, 1)
    logger.record_sleep_state(False)
    assert sleep_states() == (1, 0, 0)
    logger.record_admission_rejection("max_num_queued_reqs")
    name = "enginecore:admission_rejections_total"
    assert sample(registry, name, model_name="m", reason="max_num_queued_reqs") == 1


def test_prometheus_token_buckets_end_at_the_engines_context_length():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(make_config(model="m"), registry=registry)
    logger.max_model_len, logger.num_kv_blocks = 300, 77  # as the frontend sets them
    logger.log_engine_initialized()
    bounds = {
        s.labels["le"]
        for f in text_string_to_metric_families(exposition(registry))
        for s in f.samples
        if s.name == "enginecore:request_prompt_tokens_bucket"
    }
    assert bounds == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"}
    info = sample(registry, "enginecore:cache_config_info", num_gpu_blocks="77", block_size="16")
    assert info == 1


def test_a_rejection_is_counted_once_with_data_parallel_replicas():
    from enginecore.metrics.manager import StatLoggerManager

    config = make_config(model="m", stat_loggers=["prometheus"], data_parallel_size=2)
    host = make_plugin_manager(load_entrypoints=False)
    manager = StatLoggerManager(config, host)
    assert len(manager.loggers) == 2  # one per replica
    # Rebuilt on a registry of this test's own (the manager builds them on the process's
    # default one, which other tests share).
    registry = CollectorRegistry()
    for stat_logger in manager.loggers:
        stat_logger.__init__(config, stat_logger.engine_index, registry=registry)
    manager.record_admission_rejection("max_num_queued_reqs")
    name = "enginecore:admission_rejections_total"
    assert sample(registry, name, model_name="m", reason="max_num_queued_reqs") == 1


def test_prometheus_cache_config_info_names_the_kv_cache_dtype():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(
        make_config(model="m", kv_cache_dtype="float16"), registry=registry
    )
    logger.num_kv_blocks = 77
    logger.log_engine_initialized()
    info = sample(registry, "enginecore:cache_config_info", cache_dtype="float16")
    assert info == 1
