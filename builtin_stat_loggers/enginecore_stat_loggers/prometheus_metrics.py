"""The ``prometheus`` stat logger's metric families: names, types, labels and buckets.

Every family exists under the ``enginecore:`` prefix and, with
``observability.metrics_name_compat = "vllm"``, under ``vllm:`` too. The names after the
prefix, the types, the label names and (under ``vllm:``) the histogram buckets are
vLLM's own (``vllm/v1/metrics/loggers.py``), so a query written for vLLM reads the same
series here. Under ``enginecore:`` the latency histograms keep finer low buckets: a small
model on a CPU answers in milliseconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "enginecore:"
#: vLLM's prefix: with ``observability.metrics_name_compat = "vllm"`` every metric is
#: exported under it too.
VLLM_PREFIX = "vllm:"

LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class Buckets:
    """Histogram bucket bounds per family of histograms (vLLM's ``buckets.py`` keys)."""

    request_latency: tuple[float, ...]
    time_to_first_token: tuple[float, ...]
    inter_token_latency: tuple[float, ...]
    iteration_tokens: tuple[float, ...] = (1, *(2**k for k in range(3, 15)))  # 1, 8 .. 16384
    request_params_n: tuple[float, ...] = (1, 2, 5, 10, 20)
    request_num_preemptions: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)


_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip

_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_INTER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip

#: vLLM's default buckets, for the ``vllm:`` families.
VLLM_BUCKETS = Buckets(
    request_latency=_REQUEST_LATENCY,
    time_to_first_token=_TTFT,
    inter_token_latency=_INTER_TOKEN,
)
#: The ``enginecore:`` families: vLLM's, with millisecond buckets below them.
ENGINECORE_BUCKETS = Buckets(
    request_latency=(0.01, 0.05, 0.1, *VLLM_BUCKETS.request_latency),
    time_to_first_token=_TTFT,
    inter_token_latency=(0.001, 0.005, *VLLM_BUCKETS.inter_token_latency),
)

#: ``request_success``'s ``finished_reason`` values, created at 0 as vLLM does.
FINISH_REASONS = ("stop", "length", "abort", "error")
#: ``num_requests_waiting_by_reason``: ``deferred`` are requests parked until a KV
#: connector has loaded their prompt's KV; ``capacity`` the rest.
WAITING_REASONS = ("capacity", "deferred")
#: ``prompt_tokens_by_source``: computed here, found in the prefix cache, or loaded by a
#: KV connector.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``prompt_tokens_cached_by_source``: the tier that supplied cached prompt tokens.
CACHED_TOKEN_SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
#: ``engine_sleep_state``'s ``sleep_state`` values.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets for token counts per request: 1, 2, 5, 10, 20, 50, ... up to the
    context length."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class MetricFamilies:
    """Every family under one prefix, in one registry (created once, shared by the
    registry's loggers)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str,
        buckets: Buckets,
    ) -> None:
        self._registry = registry
        self._prefix = prefix
        self._lock = threading.Lock()

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(prefix + name, doc, (*LABELS, *extra), registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, (*LABELS, *extra), registry=registry)

        def histogram(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, LABELS, buckets=bounds, registry=registry)

        # Scheduler state, from each step's SchedulerStats.
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.num_requests_waiting_by_reason = gauge(
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: 'capacity' wait for room in the batch, 'deferred' "
            "for a KV connector to load their prompt's KV. The sum is num_requests_waiting.",
            ("reason",),
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 means 100%)."
        )
        self.engine_sleep_state = gauge(
            "engine_sleep_state",
            "Sleep state: awake=1 while the engine is awake; weights_offloaded=1 at sleep "
            "level 1, discard_all=1 at level 2.",
            ("sleep_state",),
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted.")
        self.kv_connector_rejected_messages = counter(
            "kv_connector_rejected_messages",
            "Malformed or refused messages a KV connector's servers received from peers.",
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: request steps that verified drafts."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
        )
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by draft position (0 = the first).",
            ("position",),
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Prompt tokens of the prefills that ended plus tokens generated, per engine step.",
            buckets.iteration_tokens,
        )

        # Tokens.
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.prompt_tokens_by_source = counter(
            "prompt_tokens_by_source",
            "Prompt tokens by source: computed here, found in the prefix cache, or loaded "
            "by a KV connector.",
            ("source",),
        )
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens not computed: prefix cache and KV connector."
        )
        self.prompt_tokens_cached_by_source = counter(
            "prompt_tokens_cached_by_source",
            "Cached prompt tokens by the tier that supplied them: device (the prefix "
            "cache), disk (shared_storage), p2p (zmq_p2p) or external_unspecified.",
            ("source",),
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")

        # Requests.
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.admission_rejections = Counter(
            prefix + "admission_rejections",
            "Requests refused before they reached the engine, by reason "
            "('max_num_queued_reqs': the server's queue limit).",
            ("model_name", "reason"),
            registry=registry,
        )
        self.request_params_n = histogram(
            "request_params_n", "The n request parameter.", buckets.request_params_n
        )
        self.request_num_preemptions = histogram(
            "request_num_preemptions",
            "Times each finished request was preempted.",
            buckets.request_num_preemptions,
        )

        # Latencies.
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", buckets.time_to_first_token
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets.inter_token_latency,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per finished request, the mean time per output token after the first.",
            buckets.inter_token_latency,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Request arrival to last token.", buckets.request_latency
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            buckets.request_latency,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduling to last token (prefill and decode).",
            buckets.request_latency,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduling to first token.",
            buckets.request_latency,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", buckets.request_latency
        )

        self.lora_requests_info = Gauge(
            prefix + "lora_requests_info",
            "LoRA adapters of the running and waiting requests (comma-separated names) and "
            "max_lora, as labels; the value is when they were seen (Unix time).",
            LORA_INFO_LABELS,
            registry=registry,
        )
        self.cache_config_info = Gauge(
            prefix + "cache_config_info",
            "The KV cache configuration, as labels (the value is always 1).",
            ("engine", *CACHE_CONFIG_LABELS),
            registry=registry,
        )
        self._token_histograms: TokenHistograms | None = None

    def token_histograms(self, max_model_len: int) -> TokenHistograms:
        """The histograms of token counts per request, whose buckets (1, 2, 5, 10, ...)
        end at the context length: built by the first logger that knows it."""
        with self._lock:
            if self._token_histograms is None:
                self._token_histograms = TokenHistograms(
                    self._registry, self._prefix, request_tokens_buckets(max_model_len)
                )
            return self._token_histograms


class TokenHistograms:
    """Token counts per finished request (vLLM's ``request_tokens`` bucket family)."""

    def __init__(
        self, registry: CollectorRegistry, prefix: str, request_tokens: tuple[float, ...]
    ) -> None:
        def histogram(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, LABELS, buckets=bounds, registry=registry)

        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", request_tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", request_tokens
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens computed per finished request (prefix-cache hits excluded).",
            request_tokens,
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Per user request, the most tokens any of its n samples generated.",
            request_tokens,
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", request_tokens
        )

    def all(self) -> tuple[Histogram, ...]:
        return (
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_prefill_kv_computed_tokens,
            self.request_max_num_generation_tokens,
            self.request_params_max_tokens,
        )


#: ``lora_requests_info``'s labels, as vLLM's.
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

#: ``cache_config_info``'s labels: vLLM's names for the cache settings both engines have.
CACHE_CONFIG_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "gpu_memory_utilization",
)
