"""The ``prometheus`` stat logger: metrics under the ``enginecore:`` prefix (and ``vllm:``).

Every metric carries the labels ``model_name`` and ``engine`` (the engine index, for
data parallelism); some add one more (``finished_reason``, ``reason``, ``source``,
``sleep_state``). Counters appear in the exposition text with prometheus-client's
``_total`` suffix (``enginecore:prompt_tokens_total``). The families are listed in
:mod:`.prometheus_metrics`.

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
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry

from enginecore.interfaces import IterationStats, StatLogger
from enginecore.protocol import SchedulerStats
from enginecore_stat_loggers.prometheus_metrics import (
    CACHE_CONFIG_LABELS,
    CACHED_TOKEN_SOURCES,
    ENGINECORE_BUCKETS,
    FINISH_REASONS,
    PREFIX,
    PROMPT_TOKEN_SOURCES,
    SLEEP_STATES,
    VLLM_BUCKETS,
    VLLM_PREFIX,
    WAITING_REASONS,
    MetricFamilies,
    TokenHistograms,
)

if TYPE_CHECKING:
    from enginecore.config import EngineConfig

__all__ = ["PREFIX", "REGISTRY", "VLLM_PREFIX", "PrometheusStatLogger"]

#: The registry used when none is passed: prometheus-client's default one.
REGISTRY: CollectorRegistry = prometheus_client.REGISTRY

#: The tier each KV connector's loaded tokens count under in ``prompt_tokens_cached_by_source``.
CONNECTOR_SOURCES = {"shared_storage": "disk", "zmq_p2p": "p2p"}

#: Context length assumed for the token-count buckets when none is known (a logger built
#: outside an engine, before ``max_model_len`` is resolved).
DEFAULT_MAX_MODEL_LEN = 1 << 20

_families_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, MetricFamilies]] = (
    weakref.WeakKeyDictionary()
)
_families_lock = threading.Lock()


def _families(registry: CollectorRegistry, prefix: str) -> MetricFamilies:
    with _families_lock:
        by_prefix = _families_by_registry.setdefault(registry, {})
        families = by_prefix.get(prefix)
        if families is None:
            buckets = VLLM_BUCKETS if prefix == VLLM_PREFIX else ENGINECORE_BUCKETS
            families = by_prefix[prefix] = MetricFamilies(registry, prefix, buckets)
        return families


class PrometheusStatLogger(StatLogger):
    """Feeds the Prometheus metrics from every step's stats.

    ``registry`` defaults to :data:`REGISTRY`. Tests pass their own
    :class:`~prometheus_client.CollectorRegistry` so that loggers do not see each other.
    The histograms of token counts per request are created once the context length that
    ends their buckets is known: at :meth:`log_engine_initialized`, or at the first
    :meth:`record` of a logger used outside an engine.
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
        self.prefixes = [PREFIX]
        if config.observability.metrics_name_compat == "vllm":
            self.prefixes.append(VLLM_PREFIX)
        self.speculative = config.speculative.enabled
        self.max_lora = config.lora.max_loras if config.lora.enable_lora else 0
        connector = config.kv_transfer.connector or ""
        self.connector_source = CONNECTOR_SOURCES.get(connector, "external_unspecified")
        self.all_metrics = [_families(self.registry, prefix) for prefix in self.prefixes]
        for m in self.all_metrics:
            self._create_series(m, self.engine_index)  # they exist (at 0) before any step

    def _token_histograms(self, m: MetricFamilies) -> TokenHistograms:
        max_len = self.max_model_len or self.config.model.max_model_len
        return m.token_histograms(max_len or DEFAULT_MAX_MODEL_LEN)

    def _labels(self, engine_index: int) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": str(engine_index)}

    def _create_series(self, m: MetricFamilies, engine_index: int) -> None:
        labels = self._labels(engine_index)
        for metric in (
            m.num_requests_running,
            m.num_requests_waiting,
            m.kv_cache_usage_perc,
            m.prompt_tokens,
            m.prompt_tokens_cached,
            m.generation_tokens,
            m.prefix_cache_queries,
            m.prefix_cache_hits,
            m.num_preemptions,
        ):
            metric.labels(**labels)
        for reason in WAITING_REASONS:
            m.num_requests_waiting_by_reason.labels(reason=reason, **labels)
        for source in PROMPT_TOKEN_SOURCES:
            m.prompt_tokens_by_source.labels(source=source, **labels)
        for source in CACHED_TOKEN_SOURCES:
            m.prompt_tokens_cached_by_source.labels(source=source, **labels)
        for reason in FINISH_REASONS:
            m.request_success.labels(finished_reason=reason, **labels)
        m.admission_rejections.labels(model_name=self.model_name, reason="max_num_queued_reqs")
        _set_sleep_state(m, labels, asleep=False, level=0)
        if self.speculative:
            m.spec_decode_num_drafts.labels(**labels)
            m.spec_decode_num_draft_tokens.labels(**labels)
            m.spec_decode_num_accepted_tokens.labels(**labels)
            for position in range(self.config.speculative.num_speculative_tokens):
                m.spec_decode_num_accepted_tokens_per_pos.labels(position=str(position), **labels)

    def log_engine_initialized(self) -> None:
        cache = self.config.cache
        values = (
            str(cache.tokens_per_block),
            cache.kv_cache_dtype,  # vLLM's cache_dtype label
            str(cache.prefix_caching),
            str(self.num_kv_blocks or ""),
            str(cache.gpu_memory_utilization),
        )
        info = dict(zip(CACHE_CONFIG_LABELS, values, strict=True))
        for m in self.all_metrics:
            m.cache_config_info.labels(engine=str(self.engine_index), **info).set(1)
            tokens = self._token_histograms(m)  # buckets up to the now known context length
            for histogram in tokens.all():
                histogram.labels(**self._labels(self.engine_index))

    def record_sleep_state(self, asleep: bool, level: int = 0) -> None:
        for m in self.all_metrics:
            _set_sleep_state(m, self._labels(self.engine_index), asleep=asleep, level=level)

    def record_admission_rejection(self, reason: str) -> None:
        for m in self.all_metrics:
            m.admission_rejections.labels(model_name=self.model_name, reason=reason).inc()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        # A logger built per engine is called with the default index; a logger shared by
        # several engines is told which one the stats come from.
        labels = self._labels(engine_index or self.engine_index)
        for m in self.all_metrics:
            if scheduler_stats is not None:
                self._record_scheduler(m, labels, scheduler_stats)
            if iteration_stats is not None:
                _record_iteration(m, self._token_histograms(m), labels, iteration_stats)

    def _record_scheduler(
        self, m: MetricFamilies, labels: dict[str, str], s: SchedulerStats
    ) -> None:
        m.num_requests_running.labels(**labels).set(s.num_running_reqs)
        m.num_requests_waiting.labels(**labels).set(s.num_waiting_reqs)
        deferred = s.num_waiting_for_remote_kvs
        m.num_requests_waiting_by_reason.labels(reason="capacity", **labels).set(
            s.num_waiting_reqs - deferred
        )
        m.num_requests_waiting_by_reason.labels(reason="deferred", **labels).set(deferred)
        m.kv_cache_usage_perc.labels(**labels).set(s.kv_cache_usage)
        m.prefix_cache_queries.labels(**labels).inc(s.prefix_cache_queries)
        m.prefix_cache_hits.labels(**labels).inc(s.prefix_cache_hits)
        m.num_preemptions.labels(**labels).inc(s.num_preemptions)
        m.kv_connector_rejected_messages.labels(**labels).inc(s.num_kv_rejected_messages)
        by_source = m.prompt_tokens_by_source
        by_source.labels(source="local_compute", **labels).inc(s.num_prompt_tokens_computed)
        by_source.labels(source="local_cache_hit", **labels).inc(s.prefix_cache_hits)
        by_source.labels(source="external_kv_transfer", **labels).inc(s.num_kv_loaded_tokens)
        m.prompt_tokens_cached.labels(**labels).inc(s.prefix_cache_hits + s.num_kv_loaded_tokens)
        cached = m.prompt_tokens_cached_by_source
        cached.labels(source="device", **labels).inc(s.prefix_cache_hits)
        cached.labels(source=self.connector_source, **labels).inc(s.num_kv_loaded_tokens)
        if self.max_lora:
            _record_lora(m, self.max_lora, s)
        if s.spec_num_drafts:
            m.spec_decode_num_drafts.labels(**labels).inc(s.spec_num_drafts)
            m.spec_decode_num_draft_tokens.labels(**labels).inc(s.spec_num_draft_tokens)
            m.spec_decode_num_accepted_tokens.labels(**labels).inc(s.spec_num_accepted_tokens)
            per_pos = m.spec_decode_num_accepted_tokens_per_pos
            for position, accepted in enumerate(s.spec_num_accepted_tokens_per_pos):
                per_pos.labels(position=str(position), **labels).inc(accepted)


def _record_lora(m: MetricFamilies, max_lora: int, s: SchedulerStats) -> None:
    """One series: the latest adapters (vLLM adds a series per combination seen)."""
    m.lora_requests_info.clear()
    m.lora_requests_info.labels(
        max_lora=str(max_lora),
        waiting_lora_adapters=",".join(s.waiting_lora_adapters),
        running_lora_adapters=",".join(s.running_lora_adapters),
    ).set_to_current_time()


def _set_sleep_state(m: MetricFamilies, labels: dict[str, str], asleep: bool, level: int) -> None:
    # vLLM's encoding: awake is 1 while awake; the level's own state is 1 while asleep.
    values = (int(not asleep), int(asleep and level == 1), int(asleep and level == 2))
    for sleep_state, value in zip(SLEEP_STATES, values, strict=True):
        m.engine_sleep_state.labels(sleep_state=sleep_state, **labels).set(value)


def _record_iteration(
    m: MetricFamilies, t: TokenHistograms, labels: dict[str, str], stats: IterationStats
) -> None:
    m.prompt_tokens.labels(**labels).inc(stats.num_prompt_tokens)
    m.generation_tokens.labels(**labels).inc(stats.num_generation_tokens)
    # vLLM's definition: the prompt tokens of the requests whose prefill ended in this step
    # plus the tokens it generated (cached prompt tokens count too, as the prompt counter).
    m.iteration_tokens.labels(**labels).observe(
        stats.num_prompt_tokens + stats.num_generation_tokens
    )
    _observe_all(m.time_to_first_token.labels(**labels), stats.time_to_first_tokens)
    _observe_all(m.inter_token_latency.labels(**labels), stats.inter_token_latencies)
    _observe_all(m.request_params_n.labels(**labels), stats.n_params)
    _observe_all(
        t.request_max_num_generation_tokens.labels(**labels), stats.max_num_generation_tokens
    )
    for finished in stats.finished_requests:
        m.request_success.labels(finished_reason=str(finished.finish_reason), **labels).inc()
        m.e2e_request_latency.labels(**labels).observe(finished.e2e_latency)
        m.request_queue_time.labels(**labels).observe(finished.queued_time)
        m.request_prefill_time.labels(**labels).observe(finished.prefill_time)
        m.request_inference_time.labels(**labels).observe(finished.inference_time)
        m.request_decode_time.labels(**labels).observe(finished.decode_time)
        m.request_time_per_output_token.labels(**labels).observe(finished.mean_tpot)
        m.request_num_preemptions.labels(**labels).observe(finished.num_preemptions)
        t.request_prompt_tokens.labels(**labels).observe(finished.num_prompt_tokens)
        t.request_generation_tokens.labels(**labels).observe(finished.num_generation_tokens)
        t.request_prefill_kv_computed_tokens.labels(**labels).observe(
            max(finished.num_prompt_tokens - finished.num_cached_tokens, 0)
        )
        if finished.max_tokens_param:
            t.request_params_max_tokens.labels(**labels).observe(finished.max_tokens_param)


def _observe_all(histogram: Any, values: list[float] | list[int]) -> None:
    for value in values:
        histogram.observe(value)
