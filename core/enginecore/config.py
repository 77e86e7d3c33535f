"""The one typed engine configuration: file (TOML/YAML/JSON) < CLI flags/keywords < validation.

Every field has one *flat name*, unique across sections, used as the CLI flag
(``--max-num-seqs``) and as the ``LLM(...)`` keyword (``max_num_seqs=64``). Most flat
names equal the field name; :data:`FLAT_NAME_OVERRIDES` lists the exceptions (fields
whose short name would be ambiguous, such as ``scheduler.name``).
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import pathlib
import re
import tomllib
import types
import typing
from typing import Any, Literal, Union

import msgspec

from enginecore.errors import ConfigError


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: unknown keys are errors, not silently ignored."""


class ModelConfig(_Section):
    path: str = ""
    """Checkpoint directory (HF layout) or a ``.gguf`` file."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the checkpoint."""
    served_model_name: str | None = None
    """The model name clients use in API requests; defaults to the checkpoint path."""
    served_model_aliases: list[str] = []
    """Further names the model is served under (vLLM's ``--served-model-name`` with several names: the first is ``served_model_name``, the one responses and metrics report); ``/v1/models`` lists them all."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype; ``auto`` is float32 on CPU and, on CUDA, the checkpoint's half dtype (bfloat16 for float32 checkpoints and GGUF where the GPU has it, else float16)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the checkpoint's max_position_embeddings."""
    runner: str = "torch"
    """Model runner plugin name."""
    seed: int = 0
    """Seed of the random state used by requests that do not give their own seed."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; ``auto`` picks CUDA when available."""
    attention_backend: str = "auto"
    """Attention backend plugin name; ``auto`` takes the best one that supports the device, dtype and model."""
    linear_method: str = "auto"
    """Linear method plugin name (how projection weights are stored and multiplied); ``auto`` takes the best for the device."""
    quantization: Literal["auto", "none", "int8"] = "auto"
    """``auto``: with ``linear_method`` ``auto``, a GGUF file's block-quantized projections (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and an AWQ / GPTQ checkpoint's 4-bit weights stay quantized where the ``gguf`` method runs (CPU, float32), and float checkpoints stay float; ``int8``: a float checkpoint's projections are quantized to int8 per output channel (weight-only; CPU, float32); ``none``: every weight is de-quantized at load."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (the GPU runner captures decode batches otherwise)."""
    piecewise_cuda_graphs: bool = False
    """Also capture steps with prefill or verification rows in pieces between their attention ops (attention eager), per padded token count; more start-up time and graph memory."""
    generation_config: Literal["auto", "vllm"] = "auto"
    """``auto``: the checkpoint's generation_config.json sampling values are the defaults of
    requests that leave them out; ``vllm``: they are not (vLLM's --generation-config)."""
    chat_template: str | None = None
    """A chat template (a file, or the template text) used instead of the tokenizer's."""
    task: Literal["auto", "generate", "embed"] = "auto"
    """vLLM's ``--task``: ``embed`` serves embeddings (the same as ``runner = "pooling"``); ``generate`` and ``auto`` follow ``runner``."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.task == "embed" and self.runner == "torch":
            self.runner = "pooling"
        if self.task == "generate" and self.runner == "pooling":
            raise ValueError("task 'generate' contradicts runner 'pooling' (an embedding runner)")

    @property
    def is_pooling(self) -> bool:
        """Whether this engine serves embeddings (the ``pooling`` runner) not text."""
        return self.runner == "pooling"


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block where nothing asks for another size


class CacheConfig(_Section):
    block_size: int | None = None
    """Tokens per KV cache block; unset: the attention backend's own (16; 256 for
    ``flash_attn``, which reads no smaller pages), chosen with the backend at start-up."""
    prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    prefix_caching_hash_algo: Literal["sha256", "builtin"] = "sha256"
    """Block hash function: sha256 is stable across processes (needed by KV connectors)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use for weights, activations and KV cache."""
    cpu_kv_cache_fraction: float = 0.25
    """On CPU: fraction of available RAM given to the KV cache when kv_cache_bytes is unset."""
    kv_cache_bytes: int | None = None
    """Exact KV cache size in bytes (overrides the fractions)."""
    num_blocks_override: int | None = None
    """Exact number of KV blocks (tests and benchmarks)."""
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Element type of the KV cache: ``auto`` is the model's dtype, except for a GGUF file on CPU: float16 where the attention backend keeps it, as llama.cpp does; ``float16`` or ``bfloat16`` halve a float32 model's K/V bytes (K and V are rounded when written, so outputs may differ from a float32 cache); ``float32`` keeps a float32 model's K/V unrounded (a GGUF file on CPU included). The attention backend must declare it (``enginecore plugins``)."""

    @property
    def tokens_per_block(self) -> int:
        """``block_size``, or 16 where it is unset and no engine has chosen it yet."""
        return DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 0.0 < self.cpu_kv_cache_fraction <= 1.0:
            raise ValueError("cpu_kv_cache_fraction must be in (0, 1]")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError("num_blocks_override must be >= 2")


class SchedulerConfig(_Section):
    name: str = "default"
    """Scheduler plugin name."""
    policy: str = "fcfs"
    """Scheduling policy plugin name (fcfs, priority, or one a plugin registers)."""
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step; defaults to 2048 with chunked prefill, else max_model_len."""
    chunked_prefill: bool = True
    """Split long prompts across steps so decodes are never starved."""
    long_prefill_token_threshold: int = 0
    """Cap on one prefill chunk while other requests compete (0: no cap)."""
    async_scheduling: bool = True
    """Schedule step N+1 while step N computes (placeholders for unsampled tokens)."""
    async_scheduling_adaptive: bool = False
    """With async scheduling, time the steps of each batch size both ways and run a
    size the synchronous way where that measured faster (little to overlap: a short
    forward, or a forward in the engine's process on every core); outputs are the same.
    Off by default: its probes cost more than the choice gained where it was measured."""
    max_num_seqs_per_client: int | None = None
    """While more than one client has unfinished requests (and for 32 steps after), at
    most this many of one client's requests run in a step, taking turns, so one client's
    flood cannot make every step slow for the others; a new client's request is admitted
    ahead of the flooder's queue (0: no cap; unset: 16 on CPUs, 0 on GPUs). A client is
    what the policy's ``client_key`` names: under ``enginecore serve``, its address."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs_per_client is not None and self.max_num_seqs_per_client < 0:
            raise ValueError("max_num_seqs_per_client must be >= 0")


class ParallelConfig(_Section):
    executor: str = "auto"
    """Executor plugin name (uni, mp, ray, external_launcher); auto picks by world size."""
    tensor_parallel_size: int = 1
    """Ranks a layer is split over."""
    pipeline_parallel_size: int = 1
    """Pipeline stages. World size = tensor x pipeline."""
    data_parallel_size: int = 1
    """Engine-core replicas behind one frontend (each with its own TP x PP workers)."""
    data_parallel_backend: Literal["auto", "mp", "ray"] = "auto"
    """How replicas start: mp (local processes) or ray (one placement group per replica);
    auto is ray with the ray executor or a ray_address, else mp."""
    data_parallel_external_lb: bool = False
    """Every request names its replica (data_parallel_rank); the frontend does not balance."""
    data_parallel_host: str = "127.0.0.1"
    """Address the frontend binds its ZeroMQ TCP sockets on for Ray replicas to connect to."""
    data_parallel_failover: Literal["error", "retry"] = "error"
    """When a replica dies, its in-flight requests fail (error), or those that have produced
    no output yet are resubmitted once to a live replica (retry); streamed ones still fail."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto is NCCL on CUDA, gloo on CPU."""
    ray_address: str | None = None
    """Address of an existing Ray cluster; a local one is started when unset."""
    cpu_reserved_cores: int | None = None
    """CPU cores kept free of torch threads for the frontend (HTTP server, tokenizer,
    detokenizer), except in steps with 512+ prompt tokens. Unset: 1 under ``enginecore
    serve``, 0 otherwise."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cpu_reserved_cores is not None and self.cpu_reserved_cores < 0:
            raise ValueError("cpu_reserved_cores must be >= 0")
        if self.data_parallel_backend == "auto":
            on_ray = self.executor == "ray" or self.ray_address is not None
            self.data_parallel_backend = "ray" if on_ray else "mp"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class EngineProcessConfig(_Section):
    multiprocessing: bool = True
    """Run the engine core in its own process (ZeroMQ); False runs it in-process."""
    shutdown_timeout: float = 0.0
    """Seconds to drain in-flight requests on shutdown (0: abort them)."""
    ready_timeout: float = 600.0
    """Seconds to wait for the engine process to load the model and answer the handshake."""
    execute_timeout: float | None = 300.0
    """Watchdog: seconds one step (execute_model, sample_tokens) may take on worker
    processes (mp executor), or one step or added request in the engine core (in its own
    process: plus a 5 s grace; in-process, ``multiprocessing = false``: exactly); beyond
    it in-flight requests fail naming the rank, or the plugin found hanging, and the
    engine is declared dead. Null: no watchdog."""

    rpc_timeout: float = 60.0
    """Seconds a registered worker RPC (``collective_rpc(name)``, ``enginecore rpc``) may
    run when the call gives no timeout; past it the call fails naming the RPC and the
    worker goes on serving (the RPC's thread is abandoned)."""
    frontend_plugin_timeout: float = 5.0
    """Seconds one call of plugin code in the frontend (a stat logger's ``record`` or
    ``log``, a tool or reasoning parser's ``parse``) may take; past it a stat logger is
    disabled and named, a parser fails its request (500 naming the parser), and the
    call's thread is abandoned."""

    def __post_init__(self) -> None:
        if self.execute_timeout is not None and self.execute_timeout <= 0:
            raise ValueError("execute_timeout must be > 0 (or null: no watchdog)")
        if self.rpc_timeout <= 0:
            raise ValueError("rpc_timeout must be > 0")
        if self.frontend_plugin_timeout <= 0:
            raise ValueError("frontend_plugin_timeout must be > 0")


class KVTransferConfig(_Section):
    connector: str | None = None
    """KV connector plugin name."""
    role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    """Whether this engine saves KV, loads it, or both."""
    extra_config: dict[str, Any] = {}
    """Connector-specific settings (for example a storage path)."""


class ObservabilityConfig(_Section):
    stat_loggers: list[str] = msgspec.field(default_factory=lambda: ["logging"])
    """Stat logger plugin names."""
    log_stats_interval: float = 10.0
    """Seconds between periodic stat log lines."""
    log_requests: bool = False
    """Log each request as it arrives (uvicorn's access log)."""
    metrics_name_compat: Literal["none", "vllm"] = "none"
    """``vllm``: the Prometheus metrics are exported under vLLM's ``vllm:`` names too, so
    dashboards written for vLLM work unchanged."""
    trace_dir: str | None = None
    """Directory ``trace_next_steps`` writes its owner-only trace files to, fixed at
    start-up (a caller never names a path); null: ``~/.cache/enginecore/traces``."""
    trace_prompt_contents: bool = False
    """Traces keep prompt and output token ids and sampling strings (otherwise only
    their counts)."""


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: int = 8000
    """Its port."""
    api_server_count: int = 1
    """API server processes (vLLM's ``--api-server-count``): each has its own tokenizer and detokenizer, all accept on the one listening socket, in front of one engine core ([serving.md](serving.md))."""
    api_key: str | None = None
    """When set, requests must send ``Authorization: Bearer <key>``."""
    max_request_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body."""
    max_n: int = 16
    """Largest ``n`` (completions per prompt) a request may ask for."""
    max_tokens_limit: int | None = None
    """Upper bound on a request's ``max_tokens``; null: only ``max_model_len`` bounds it."""
    max_logprobs: int = 20
    """Largest ``logprobs`` (or ``top_logprobs``, ``prompt_logprobs``) a request may ask
    for; -1: the whole vocabulary, which a request's -1 then asks for (vLLM's -1)."""
    max_json_depth: int = 32
    """Deepest nesting of objects and arrays a request body may have."""
    max_field_bytes: int = 262144
    """Largest JSON size of each free-form field (metadata, kv_transfer_params, a JSON
    schema, logit_bias, tools, chat_template_kwargs)."""
    max_logit_bias_entries: int = 1024
    """Most token ids one request's logit_bias may name."""
    max_tools: int = 128
    """Most tools one chat request may declare."""
    max_prompts_per_request: int = 256
    """Most prompts in one completions request."""
    max_prompt_tokens_per_request: int = 262144
    """Most prompt tokens of one request, all its prompts together."""
    max_pending_requests: int = 4096
    """Most unfinished requests (running or waiting) the server holds; beyond it (or with
    as many messages still queued for the engine) new requests get 503 with Retry-After."""
    max_pending_requests_per_client: int = 1024
    """Most unfinished generation requests one client (its API key, else its address)
    may hold; beyond it its new requests get 429 with Retry-After, so one client cannot
    fill the queue for everyone."""
    max_stored_response_bytes: int = 64 * 1024 * 1024
    """Most bytes of JSON the Responses API keeps for ``previous_response_id`` (oldest
    dropped first)."""
    max_open_connections: int = 2048
    """Most open HTTP connections; beyond it a new request gets 503 at once (``/health``,
    ``/ping``, ``/metrics`` and ``/version`` still answer, within a small reserve)."""
    max_open_connections_per_client: int = 1024
    """Most open HTTP connections from one client address; beyond it that address's new
    requests get 503 at once (and, past a small reserve, its new connections are closed),
    while other addresses still connect. Behind a proxy every client shares its address."""
    request_header_timeout: float = 10.0
    """Seconds a connection may take to send a request's headers (slow-header clients
    are disconnected)."""
    request_body_timeout: float = 60.0
    """Seconds a request may take to send its body once its headers arrived."""
    allowed_origins: list[str] = []
    """Web origins (scheme://host[:port]) whose pages may call the server from a browser;
    "*" admits any. A state-changing request with another Origin gets 403."""
    allowed_hosts: list[str] | None = None
    """Host header values the server answers (DNS rebinding); "*" admits any. Null: the
    bind address and localhost names (any, when bound to all interfaces)."""
    trust_request_chat_template: bool = False
    """Accept a ``chat_template`` sent in a chat request. Off (vLLM's default too): a
    client's Jinja template runs in the server, where two nested loops hold a thread for
    hours, so such a request gets 400."""
    enable_collective_rpc_endpoint: bool = False
    """Expose POST /collective_rpc (it runs registered worker RPCs by name: off by default)."""
    enable_auto_tool_choice: bool = False
    """Allow tool_choice "auto" in chat requests: the reply is parsed for tool calls by
    tool_call_parser (vLLM's --enable-auto-tool-choice)."""
    tool_call_parser: str | None = None
    """Name of the tool-call parser for chat tool calls (register_tool_parsers hook;
    built in: "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")."""
    reasoning_parser: str | None = None
    """Name of the reasoning parser that splits a reasoning model's thinking into the chat
    reply's reasoning_content (register_reasoning_parsers hook; built in: "qwen3",
    "deepseek_r1", "granite", "mistral")."""
    enable_sleep_mode: bool = False
    """Serve POST /sleep, POST /wake_up and GET /is_sleeping (vLLM's --enable-sleep-mode);
    off, they do not exist."""
    enable_dev_endpoints: bool = False
    """Serve POST /pause, POST /resume, GET /is_paused and POST /reset_prefix_cache (vLLM
    serves them with VLLM_SERVER_DEV_MODE=1, which turns this on too); off, they do not
    exist."""
    enable_force_include_usage: bool = False
    """Send ``usage`` in every streamed response, as if each asked for
    ``stream_options.include_usage`` (vLLM's --enable-force-include-usage)."""
    enable_server_load_tracking: bool = False
    """Count the requests in flight for ``GET /load`` (vLLM's --enable-server-load-tracking);
    off, ``/load`` answers 0."""
    unknown_request_fields: Literal["reject", "warn"] = "reject"
    """A request field this server does not know: ``reject`` answers 400 naming it;
    ``warn`` logs it once per field name and serves the request without it (vLLM's way)."""

    def __post_init__(self) -> None:
        for name in (
            "max_json_depth",
            "max_field_bytes",
            "max_logit_bias_entries",
            "max_tools",
            "max_prompts_per_request",
            "max_prompt_tokens_per_request",
            "max_pending_requests",
            "max_pending_requests_per_client",
            "max_stored_response_bytes",
            "max_open_connections",
            "max_open_connections_per_client",
            "api_server_count",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("request_header_timeout", "request_body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


class PluginsConfig(_Section):
    enabled: list[str] | None = None
    """Allow-list of third-party plugins (None: all installed; []: none)."""
    disabled: list[str] = []
    """Plugins never to load."""
    config: dict[str, dict[str, Any]] = {}
    """Each plugin's own settings by plugin name (the TOML table [plugins.NAME]),
    validated by the settings type the plugin declares."""


class SpeculativeConfig(_Section):
    speculative_method: str | None = None
    """Draft-token proposer plugin name (built in: ngram); null: no speculative decoding."""
    num_speculative_tokens: int = 0
    """Most draft tokens verified per request and step (required with a method)."""
    ngram_prompt_lookup_min: int = 1
    """Shortest suffix n-gram the ngram proposer looks up in the request's tokens."""
    ngram_prompt_lookup_max: int = 4
    """Longest suffix n-gram it looks up (the longest match wins)."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.speculative_method is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_method={self.speculative_method!r} needs num_speculative_tokens "
                ">= 1 (how many draft tokens to verify per step)"
            )
        if self.ngram_prompt_lookup_min < 1:
            raise ValueError("ngram_prompt_lookup_min must be >= 1")
        if self.ngram_prompt_lookup_max < self.ngram_prompt_lookup_min:
            raise ValueError("ngram_prompt_lookup_max must be >= ngram_prompt_lookup_min")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None and self.num_speculative_tokens > 0


class StructuredOutputConfig(_Section):
    backend: str = "xgrammar"
    """Grammar backend plugin name for ``SamplingParams(structured_output=...)``."""
    disable_any_whitespace: bool = False
    """JSON output without whitespace between tokens (a model that loops on spaces cannot)."""


class LoRAConfig(_Section):
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) on top of the base model, several in one batch."""
    max_loras: int = 1
    """Most distinct adapters in one step (each holds a slot of stacked weights on the device)."""
    max_lora_rank: int = 16
    """Highest adapter rank accepted; an adapter above it is refused when it is loaded."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (least recently used evicted); defaults to max_loras."""
    lora_modules: list[str] = []
    """Adapters served from start-up, each ``name=path`` (the name is the API's ``model``)."""
    allow_runtime_lora_updating: bool = False
    """Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with the
    environment variable ENGINECORE_ALLOW_RUNTIME_LORA_UPDATING=1)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules entry {entry!r} must be name=path")


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration. Build it with :func:`make_config`."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    engine: EngineProcessConfig = msgspec.field(default_factory=EngineProcessConfig)
    kv_transfer: KVTransferConfig = msgspec.field(default_factory=KVTransferConfig)
    observability: ObservabilityConfig = msgspec.field(default_factory=ObservabilityConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    plugins: PluginsConfig = msgspec.field(default_factory=PluginsConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = msgspec.field(
        default_factory=StructuredOutputConfig
    )
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enable_lora:
            refused = _lora_refusal(self)
            if refused:
                raise ValueError(f"enable_lora: {refused}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = msgspec.to_builtins(self)
        return data

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with some flat-named fields changed (validated like any other input)."""
        return make_config(base=self, **flat)


def _lora_refusal(config: EngineConfig) -> str | None:
    """Why LoRA cannot run with the rest of this config, or None."""
    if config.speculative.enabled:
        return (
            "speculative decoding is not supported with LoRA adapters (draft tokens are "
            "verified without a tested adapter mapping); unset speculative_method"
        )
    if config.kv_transfer.connector is not None:
        return (
            "KV connectors key blocks by prompt and cache salt, not by adapter: KV "
            "computed with one adapter could be loaded for another; unset kv_connector"
        )
    if config.parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism is not supported with LoRA adapters (TP is)"
    return None


SECTIONS: dict[str, type[_Section]] = {
    name: typing.get_type_hints(EngineConfig)[name] for name in EngineConfig.__struct_fields__
}

# (section, field) -> flat name, where the field name alone would be ambiguous.
FLAT_NAME_OVERRIDES: dict[tuple[str, str], str] = {
    ("model", "path"): "model",
    ("scheduler", "name"): "scheduler_name",
    ("scheduler", "policy"): "scheduling_policy",
    ("kv_transfer", "connector"): "kv_connector",
    ("kv_transfer", "role"): "kv_role",
    ("kv_transfer", "extra_config"): "kv_connector_extra_config",
    ("structured_output", "backend"): "structured_output_backend",
    ("plugins", "enabled"): "enabled_plugins",
    ("plugins", "disabled"): "disabled_plugins",
    ("plugins", "config"): "plugin_config",
}


def _build_flat_names() -> dict[str, tuple[str, str]]:
    flat: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for field_name in cls.__struct_fields__:
            name = FLAT_NAME_OVERRIDES.get((section, field_name), field_name)
            if name in flat:
                raise AssertionError(f"flat config name {name!r} is not unique")
            flat[name] = (section, field_name)
    return flat


FLAT_NAMES: dict[str, tuple[str, str]] = _build_flat_names()


def field_docs() -> dict[str, str]:
    """Flat name -> the field's docstring (the string under it in this module's source,
    which is parsed once: ``inspect.getsource`` would parse it once per section)."""
    import ast

    tree = ast.parse(pathlib.Path(__file__).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    docs: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        body = getattr(classes.get(cls.__name__), "body", [])
        for field, doc in itertools.pairwise(body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                flat = FLAT_NAME_OVERRIDES.get((section, field.target.id), field.target.id)
                docs[flat] = " ".join(doc.value.value.split())
    return docs


# --- loading and validation ----------------------------------------------------------


def read_config_file(path: str | pathlib.Path) -> dict[str, Any]:
    """Parse a TOML, YAML or JSON config file into plain data (not yet validated)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"config file {str(p)!r}: unknown format {suffix!r}; use .toml, .yaml, .yml or .json"
            )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid {suffix[1:]}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return data


def _unknown_key_message(key: str, where: str) -> str:
    candidates = list(FLAT_NAMES) + list(SECTIONS)
    close = difflib.get_close_matches(key, candidates, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"unknown config key {key!r} {where}.{hint} Run 'enginecore config show' to list every key."
    )


def _merge_into(tree: dict[str, dict[str, Any]], data: dict[str, Any], where: str) -> None:
    """Merge sections and flat names from ``data`` into ``tree`` (section -> field -> value)."""
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            section = tree.setdefault(key, {})
            for field_name, field_value in value.items():
                if key == "plugins" and _is_plugin_table(field_name, field_value):
                    section.setdefault("config", {})[field_name] = field_value
                    continue
                section[field_name] = field_value  # unknown fields: msgspec names them
        elif key == "served_model_name" and isinstance(value, list):
            _merge_served_names(tree, value, where)
        elif key in FLAT_NAMES:
            section_name, field_name = FLAT_NAMES[key]
            tree.setdefault(section_name, {})[field_name] = value
        elif key in SECTIONS and isinstance(value, msgspec.Struct):
            tree[key] = msgspec.to_builtins(value)
        else:
            raise ConfigError(_unknown_key_message(key, where))


def _merge_served_names(tree: dict[str, dict[str, Any]], names: list[Any], where: str) -> None:
    """Several served names, as vLLM takes them: the first reported, the rest aliases."""
    if not names:
        raise ConfigError(f"served_model_name {where} is an empty list: give at least one name")
    model = tree.setdefault("model", {})
    model["served_model_name"], model["served_model_aliases"] = names[0], list(names[1:])


def _is_plugin_table(key: str, value: Any) -> bool:
    """``[plugins.NAME]``: a table under ``plugins`` that is not one of its own fields."""
    return key not in PluginsConfig.__struct_fields__ and isinstance(value, dict)


_PATH_RE = re.compile(r"at `\$\.(\w+)(?:\.(\w+))?")


def _validate(tree: dict[str, Any]) -> EngineConfig:
    try:
        return msgspec.convert(tree, EngineConfig, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH_RE.search(text)
        hint = ""
        if match and match.group(2):
            section, field_name = match.groups()
            flat = FLAT_NAME_OVERRIDES.get((section, field_name), field_name)
            hint = f" (flag --{flat.replace('_', '-')})."
        if "unknown field" in text:
            bad = re.search(r"unknown field `(\w+)`", text)
            if bad:
                close = difflib.get_close_matches(bad.group(1), list(FLAT_NAMES), n=3)
                if close:
                    hint += f". Did you mean {', '.join(repr(c) for c in close)}?"
        raise ConfigError(f"invalid config: {text}{hint}") from None


def make_config(
    config_file: str | pathlib.Path | None = None,
    *,
    base: EngineConfig | None = None,
    **overrides: Any,
) -> EngineConfig:
    """Resolve a config: defaults (or ``base``) < file < overrides, then validate.

    ``overrides`` are flat names (``max_num_seqs=64``) or whole sections as dicts
    (``kv_transfer={"connector": "shared_storage"}``). ``None`` values are ignored so
    that unset CLI flags do not override the file.
    """
    tree: dict[str, dict[str, Any]] = base.to_dict() if base is not None else {}
    if config_file is not None:
        _merge_into(tree, read_config_file(config_file), f"in config file {str(config_file)!r}")
    _merge_into(tree, {k: v for k, v in overrides.items() if v is not None}, "(not a config field)")
    return _validate(tree)


# --- CLI flags ----------------------------------------------------------------------


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _json_flag(text: str) -> Any:
    """A flag whose value is JSON; text that is not is argparse's one-line error (the
    config's validation then names a value of the wrong shape)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None


# List flags given as separate words, as vLLM's (``--lora-modules a=PATH b=PATH``).
_SPACE_SEPARATED_LISTS = frozenset({"lora_modules"})


def add_config_flags(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add ``--flat-name`` for every config field; unset flags stay None (file wins)."""
    docs = field_docs()
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        hints = typing.get_type_hints(cls)
        for field_name in cls.__struct_fields__:
            flat = FLAT_NAME_OVERRIDES.get((section, field_name), field_name)
            if flat in skip:
                continue
            tp = _strip_optional(hints[field_name])
            flag = "--" + flat.replace("_", "-")
            kwargs: dict[str, Any] = {"dest": flat, "default": None, "help": docs.get(flat, "")}
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif flat in _SPACE_SEPARATED_LISTS:
                kwargs.update(nargs="+", action="extend", metavar="NAME=PATH")
            elif typing.get_origin(tp) is list:
                kwargs.update(type=lambda s: [x for x in s.split(",") if x], metavar="A,B")
            elif typing.get_origin(tp) is dict:
                kwargs.update(type=_json_flag, metavar="JSON")
            elif typing.get_origin(tp) is Literal:
                kwargs["choices"] = list(typing.get_args(tp))
            elif tp in (int, float, str):
                kwargs["type"] = tp
            group.add_argument(flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the config from a parsed namespace with ``--config`` and the flat flags."""
    overrides = {flat: getattr(args, flat, None) for flat in FLAT_NAMES}
    return make_config(getattr(args, "config", None), **overrides)
