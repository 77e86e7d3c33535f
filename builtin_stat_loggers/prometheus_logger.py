"""The ``prometheus`` stat logger: metrics under the ``enginecore:`` prefix.

Every metric carries the labels ``model_name`` and ``engine`` (the engine index, for
data parallelism); ``request_success`` adds ``finished_reason``. Counters appear in the
exposition text with prometheus-client's ``_total`` suffix
(``enginecore:prompt_tokens_total``).

Metrics live in a :class:`prometheus_client.CollectorRegistry`: the one passed to the
logger, else :data:`REGISTRY` (prometheus-client's process-wide default, which the HTTP
server's ``/metrics`` exposes). The metric families are created once per registry and
shared by every logger on it, so several engines (or several ``LLM`` objects in one
process) write to the same families under their own labels instead of failing with
"duplicated timeseries".
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from enginecore.interfaces import IterationStats, StatLogger
from enginecore.protocol import SchedulerStats

if TYPE_CHECKING:
    from enginecore.config import EngineConfig

PREFIX = "enginecore:"
#: vLLM's prefix: with ``observability.metrics_name_compat = "vllm"`` every metric is
#: exported under it too (the names after the prefix are vLLM's own).
VLLM_PREFIX = "vllm:"

#: The registry used when none is passed: prometheus-client's default one.
REGISTRY: CollectorRegistry = prometheus_client.REGISTRY

LABELS = ("model_name", "engine")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                           1920.0, 7680.0)  # fmt: skip


class _Families:
    """The metric families of one registry under one prefix (created once, shared by the
    registry's loggers)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = PREFIX) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, LABELS, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, (*LABELS, *extra), registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, LABELS, buckets=buckets, registry=registry)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 means 100%)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted.")
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: request steps that verified drafts."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
        )
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Request arrival to last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )


_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _Families]] = (
    weakref.WeakKeyDictionary()
)
_families_lock = threading.Lock()


def _families(registry: CollectorRegistry, prefix: str = PREFIX) -> _Families:
    with _families_lock:
        by_prefix = _families_by_registry.setdefault(registry, {})
        families = by_prefix.get(prefix)
        if families is None:
            families = by_prefix[prefix] = _Families(registry, prefix)
        return families


class PrometheusStatLogger(StatLogger):
    """Feeds the ``enginecore:*`` Prometheus metrics from every step's stats.

    ``registry`` defaults to :data:`REGISTRY`. Tests pass their own
    :class:`~prometheus_client.CollectorRegistry` so that loggers do not see each other.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(config, engine_index)
        self.registry = REGISTRY if registry is None else registry
        self.model_name = config.model.served_model_name or config.model.path or "unknown"
        self.metrics = _families(self.registry)
        self.all_metrics = [self.metrics]
        if config.observability.metrics_name_compat == "vllm":
            self.all_metrics.append(_families(self.registry, VLLM_PREFIX))
        self.speculative = config.speculative.enabled
        for m in self.all_metrics:
            self._labels(m, engine_index)  # the series exist (at 0) before the first step

    def _labels(self, m: _Families, engine_index: int) -> dict[str, str]:
        labels = {"model_name": self.model_name, "engine": str(engine_index)}
        for metric in (
            m.num_requests_running,
            m.num_requests_waiting,
            m.kv_cache_usage_perc,
            m.prompt_tokens,
            m.generation_tokens,
            m.prefix_cache_queries,
            m.prefix_cache_hits,
            m.num_preemptions,
        ):
            metric.labels(**labels)
        if self.speculative:
            m.spec_decode_num_drafts.labels(**labels)
            m.spec_decode_num_draft_tokens.labels(**labels)
            m.spec_decode_num_accepted_tokens.labels(**labels)
        return labels

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        # A logger built per engine is called with the default index; a logger shared by
        # several engines is told which one the stats come from.
        labels = {
            "model_name": self.model_name,
            "engine": str(engine_index or self.engine_index),
        }
        for m in self.all_metrics:
            _record(m, labels, scheduler_stats, iteration_stats)


def _record(
    m: _Families,
    labels: dict[str, str],
    scheduler_stats: SchedulerStats | None,
    iteration_stats: IterationStats | None,
) -> None:
    if scheduler_stats is not None:
        m.num_requests_running.labels(**labels).set(scheduler_stats.num_running_reqs)
        m.num_requests_waiting.labels(**labels).set(scheduler_stats.num_waiting_reqs)
        m.kv_cache_usage_perc.labels(**labels).set(scheduler_stats.kv_cache_usage)
        m.prefix_cache_queries.labels(**labels).inc(scheduler_stats.prefix_cache_queries)
        m.prefix_cache_hits.labels(**labels).inc(scheduler_stats.prefix_cache_hits)
        m.num_preemptions.labels(**labels).inc(scheduler_stats.num_preemptions)
        if scheduler_stats.spec_num_drafts:
            s = scheduler_stats
            m.spec_decode_num_drafts.labels(**labels).inc(s.spec_num_drafts)
            m.spec_decode_num_draft_tokens.labels(**labels).inc(s.spec_num_draft_tokens)
            m.spec_decode_num_accepted_tokens.labels(**labels).inc(s.spec_num_accepted_tokens)
    if iteration_stats is None:
        return
    m.prompt_tokens.labels(**labels).inc(iteration_stats.num_prompt_tokens)
    m.generation_tokens.labels(**labels).inc(iteration_stats.num_generation_tokens)
    ttft = m.time_to_first_token.labels(**labels)
    for value in iteration_stats.time_to_first_tokens:
        ttft.observe(value)
    itl = m.inter_token_latency.labels(**labels)
    for value in iteration_stats.inter_token_latencies:
        itl.observe(value)
    for finished in iteration_stats.finished_requests:
        m.request_success.labels(finished_reason=str(finished.finish_reason), **labels).inc()
        m.e2e_request_latency.labels(**labels).observe(finished.e2e_latency)
        m.request_queue_time.labels(**labels).observe(finished.queued_time)
