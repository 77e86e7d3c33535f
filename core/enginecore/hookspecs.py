"""Every hook enginecore calls, in lifecycle order. This file is the plugin contract.

A plugin is a module (or object) holding functions decorated with ``@enginecore.hookimpl``
whose names and argument names match the specs below. A plugin may implement any subset
of the hooks, and may accept any subset of a hook's arguments.

Third-party plugins are found through the ``enginecore`` entry-point group::

    [project.entry-points.enginecore]
    myplugin = "mypkg.plugin"

Built-in components register through exactly the same hooks (marked ``trylast``); a
plugin replaces one explicitly with ``override=True``, whichever runs first.

Hooks are called through pluggy, so ``wrapper=True`` and ``hookwrapper=True``
implementations work as pluggy documents. Registration hooks are called once per
process, all together, when the process first needs a registry; a plugin that raises in
one contributes nothing to any. Lifecycle hooks are observers: they are never in the
per-token path, their return values are ignored, and an exception in one is logged with
the plugin's name and does not stop the engine or the other observers.

Stability: every hook here is part of the versioned public API
(``enginecore.PLUGIN_API_VERSION``). A change to a hook's name or arguments bumps the
major version; a new hook bumps the minor version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from enginecore.config import EngineConfig
    from enginecore.registry import Registry

PROJECT_NAME = "enginecore"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- 0. Compatibility ---------------------------------------------------------------


@hookspec(firstresult=True)
def plugin_api_versions() -> str | None:
    """Declare which versions of the plugin API this plugin supports.

    Return a version specifier string in PEP 440 form, for example ``">=1.0,<2"``.
    A plugin whose range excludes ``enginecore.PLUGIN_API_VERSION`` is refused at load
    time with a message naming the version it needs. Plugins that do not implement this
    hook are assumed to be compatible.
    A plain string attribute ``plugin_api_versions = ">=1.0,<2"`` on the plugin module or
    object is accepted too.

    Called once per plugin, right after the plugin is registered (the plugin manager
    calls each plugin's implementation on its own, so ``firstresult`` only matters to
    callers that ask the whole hook). A plugin may also declare ``plugin_settings``, the
    ``msgspec.Struct`` type (or ``"module:Type"``) of its ``[plugins.NAME]`` config table.
    """


# --- 1. Component registration (once per process) ------------------------------------


@hookspec
def register_schedulers(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.Scheduler` implementations.

    Call ``registry.add(name, factory, summary="...")`` where ``factory`` is the class or a
    lazy ``"module:Class"`` string (imported only when selected). Selected by the config
    key ``scheduler.name`` (flat name ``scheduler_name``; default ``"default"``).

    Most plugins should not need this hook: a new *scheduling policy*
    (``register_scheduling_policies``) changes ordering, admission and preemption and
    keeps async scheduling, chunked prefill and prefix caching for free.
    """


@hookspec
def register_scheduling_policies(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.SchedulingPolicy` implementations.

    A policy decides the order of the waiting queue (``sort_key``), whether a request may
    be admitted now (``admit``, which sees the running and waiting requests through its
    ``SchedulerState``) and which running request to preempt when the KV cache is full
    (``pick_preemption_victim``). Policies keep no state of their own. Selected by ``scheduler.policy`` (flat name
    ``scheduling_policy``; built in: ``"fcfs"``, ``"priority"``).

    ``admit()`` returning False does not block the queue: that request waits and the
    scheduler goes on to the next one in ``sort_key`` order, asking again next step.
    Tenant information reaches a policy through ``Request.extra``: an OpenAI request's
    ``metadata`` object becomes ``extra`` and its ``user`` field ``extra["user"]``
    (offline, ``SamplingParams(extra={...})``). ``sort_key`` runs in the engine loop for
    every waiting request each step: it must return values comparable with each other
    (the error names the plugin otherwise) and must not block.
    """


@hookspec
def register_executors(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.Executor` implementations.

    Selected by ``parallel.executor`` (flat name ``executor``). Built in: ``"uni"``,
    ``"mp"``, ``"ray"``, ``"external_launcher"``; ``"auto"`` picks ``uni`` for a world
    size of one and ``mp`` otherwise (and ``mp`` for one CPU rank with
    ``cpu_reserved_cores`` > 0, as under ``enginecore serve``).
    """


@hookspec
def register_model_runners(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.ModelRunner` implementations.

    Selected by ``model.runner`` (flat name ``runner``; default ``"torch"``). The runner is
    built inside each worker process.
    """


@hookspec
def register_models(registry: Registry[Any]) -> None:
    """Register model classes by Hugging Face architecture name.

    The name is the string in the checkpoint's ``config.json`` ``architectures`` list, for
    example ``"LlamaForCausalLM"``. The factory is called by the model runner as
    ``factory(hf_config, parallel, dtype)`` (the transformers config, this rank's
    :class:`enginecore.distributed.ParallelContext` and the ``torch.dtype`` to build in)
    and returns a ``torch.nn.Module`` built from :mod:`enginecore.layers` with the
    interface described in ``docs/plugins.md``, "Writing a model": ``forward(input_ids,
    positions, kv_caches, attn_context, hidden_states=None)``, ``compute_logits`` and
    ``load_weights``. ``registry.add(..., features=[...])`` declares what the architecture
    supports, from ``"sliding_window"``, ``"moe"``, ``"gguf"``, ``"tp"``, ``"pp"``;
    ``enginecore models`` lists it.
    """


@hookspec
def register_attention_backends(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.AttentionBackend` classes by name.

    A backend owns the KV cache layout, builds its per-step metadata from the runner's
    :class:`enginecore.layers.AttentionBatch` (block tables, sequence lengths, query start
    offsets, slot mapping) and, for every :class:`enginecore.layers.Attention` layer,
    writes the step's K/V into the paged cache and attends over a mixed batch (prefills
    with and without context, decodes, speculative verification). It declares what it
    supports in ``capabilities`` (devices, dtypes, head sizes, sliding window, logit
    soft-capping, CUDA graphs); ``enginecore plugins`` lists them.

    Selected by ``model.attention_backend`` (flat name ``attention_backend``); ``"auto"``
    (the default) takes the supporting backend with the highest ``priority`` for the
    device, dtype and model. Built in: ``torch`` (any device, the reference), ``cpu`` (C
    kernels and a dense decode mirror), ``triton`` (paged attention kernels for GPUs;
    on CPU only when selected by name, under ``TRITON_INTERPRET=1``) and ``flash_attn``
    (when that package is importable). Test one with
    :class:`enginecore.testing.AttentionBackendContract`.

    The memory-profiling forward at start-up passes as ``metadata`` what
    ``build_profile_metadata(query_lens)`` returns (by default the plain list of the
    fresh prompts' query lengths) with ``kv_cache=None``: a backend whose ``forward``
    needs its own metadata type overrides ``build_profile_metadata``. A backend that
    raises in ``__init__`` fails start-up with an error naming the backend, its plugin
    and ``model.attention_backend``; one whose registration is not an
    ``AttentionBackend`` subclass is dropped when registered and named by
    ``enginecore plugins --check``.
    """


@hookspec
def register_linear_methods(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.LinearMethod` classes by name.

    A linear method owns how a projection's weights are stored and multiplied:
    ``create_weights`` (in the layer's constructor), ``process_weights_after_loading``
    (repack, quantize) and ``apply`` (every forward). Every linear layer in
    :mod:`enginecore.layers` and the LM head compute through the selected method, so a
    weight format plugs in here without touching a model.

    Selected by ``model.linear_method`` (flat name ``linear_method``); ``"auto"`` (the
    default) takes the supporting method with the highest ``priority`` for the device
    and dtype. Built in: ``unquantized`` (``F.linear``, any device) and ``cpu_packed``
    (weights packed for the CPU's GEMM). Test one with
    :class:`enginecore.testing.LinearMethodContract`; its ``tolerance`` is a dict by
    activation dtype name (``{"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}``),
    so a quantizing method overrides the whole dict.

    In ``create_weights`` give every parameter the layer's loader, as the built-in
    does: ``set_weight_attrs(param, {"weight_loader": layer.weight_loader})`` (from
    :mod:`enginecore.layers.weights`). ``process_weights_after_loading`` is also called
    for the LM head, a :class:`enginecore.layers.VocabParallelEmbedding` whose table is
    shared with the embedding lookup: a method that repacks only projections returns
    early for it (``if isinstance(layer, VocabParallelEmbedding): return``). Weight
    preparation runs at start-up inside ``engine.ready_timeout``; a layer whose preparation
    has not returned after 30 s is logged as an error naming the method, its plugin and
    the layer. A method that raises in ``__init__`` fails start-up naming the method,
    its plugin and ``model.linear_method``.
    """


@hookspec
def register_kv_connectors(registry: Registry[Any]) -> None:
    """Register KV connectors by name.

    The factory (:class:`enginecore.interfaces.KVConnectorFactory`) returns an object
    with two methods, ``scheduler_side(config)`` (called in the engine-core process
    before the workers start) and ``worker_side(config, rank)`` (called in each worker
    once its KV cache exists), building the two halves
    (:class:`enginecore.interfaces.KVConnectorScheduler` and
    :class:`enginecore.interfaces.KVConnectorWorker`). Selected by
    ``kv_transfer.connector`` (flat name ``kv_connector``); built in: ``shared_storage``
    and ``zmq_p2p`` (docs/kv_transfer.md). Test one with
    :class:`enginecore.testing.KVConnectorContract`.

    The kit requires ``delay_free`` for every request whose KV is saved, synchronous
    saves included: the scheduler keeps its blocks until the worker reports it in
    ``finished_sending``. A ``scheduler_side`` that raises fails start-up naming the
    connector, its plugin and ``kv_transfer.connector``. Build connectors only on
    :mod:`enginecore.interfaces` (``enginecore plugin new NAME --kind kv-connector``
    writes one); the built-in connectors' modules are internal.

    A request's ``kv_transfer_params`` come from clients: declare their type as the
    factory's ``transfer_params_type`` (a :class:`msgspec.Struct`, checked in the frontend,
    400 naming the field) and put checks that need the configuration in
    ``check_transfer_params``. Never connect to an address a client supplies: take peers
    from the connector's configuration.
    """


@hookspec
def register_stat_loggers(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.StatLogger` implementations.

    Selected by the list ``observability.stat_loggers`` (built in: ``"logging"``,
    ``"prometheus"``). Stat loggers run in the frontend process and receive scheduler
    stats, iteration stats and per-finished-request stats.
    """


@hookspec
def register_worker_rpcs(registry: Registry[Any]) -> None:
    """Register named functions callable on every worker through ``collective_rpc(name)``.

    The factory is a function ``fn(worker, *args, **kwargs)``; it runs inside each worker
    process with the :class:`enginecore.interfaces.Worker` as first argument, and its
    return value (which must be msgpack- or pickle-serialisable) is sent back per rank.

    Built in (for debugging; ``enginecore rpc NAME`` calls them on a running server):
    ``memory_snapshot``, ``kv_cache_stats``, ``model_summary`` and ``trace_next_steps(n)``.
    Only names registered here can be called from outside (``enginecore rpc``,
    ``POST /collective_rpc``), never a Worker's own methods.

    Each call has a time limit: the call's ``timeout``, or ``engine.rpc_timeout``
    (60 s by default; ``enginecore rpc --timeout``). The function runs on a thread of
    its own in the worker, so past the limit the caller gets an error naming the RPC
    and the worker goes on serving; the stuck thread is abandoned, not stopped, so an
    RPC must not take locks the model's forward needs.
    """


@hookspec
def register_structured_output_backends(registry: Registry[Any]) -> None:
    """Register grammar backends for constrained decoding.

    The factory is a :class:`enginecore.interfaces.StructuredOutputBackend` subclass,
    built in the engine-core process as ``cls(config, tokenizer=..., vocab_size=...,
    eos_token_ids=...)`` the first time a request carries a constraint. Its
    ``validate`` classmethod also runs in the frontend. Selected by
    ``structured_output.backend`` (flat name ``structured_output_backend``; default
    ``"xgrammar"``).
    """


@hookspec
def register_spec_decode_proposers(registry: Registry[Any]) -> None:
    """Register draft-token proposers for speculative decoding.

    The factory is a :class:`enginecore.interfaces.SpecDecodeProposer` subclass (or a lazy
    ``"module:Class"`` string), built in each worker as ``cls(config)``; after every
    sampling step the model runner calls ``propose(token_ids, max_num_drafts)`` for each
    request and verifies the drafts in the next step. Selected by
    ``speculative.speculative_method`` (built in: ``"ngram"``), with at most
    ``speculative.num_speculative_tokens`` drafts per step. Verification keeps the output
    exactly as without speculation, so a proposer only changes speed; it must be
    deterministic, since every rank of a parallel engine proposes for itself.
    """


@hookspec
def register_tool_parsers(registry: Registry[Any]) -> None:
    """Register tool-call parsers for ``/v1/chat/completions`` by name.

    The factory is called as ``factory(tokenizer)`` once per request and returns an
    :class:`enginecore.tool_parsers.ToolParser` (implement its ``parse(text,
    final)``; whole and streamed tool calls are derived from it). Selected by
    ``server.tool_call_parser`` (flag ``--tool-call-parser``; built in: ``"hermes"``,
    ``"llama3_json"``, ``"mistral"``, ``"pythonic"``, ``"qwen3_coder"``).
    """


@hookspec
def register_reasoning_parsers(registry: Registry[Any]) -> None:
    """Register reasoning parsers for ``/v1/chat/completions`` and ``/v1/responses`` by name.

    The factory is called as ``factory(tokenizer)`` once per request and returns an
    :class:`enginecore.reasoning_parsers.ReasoningParser`: implement ``parse(text,
    final)``, returning a ``ParsedReasoning(reasoning, content, ended)`` for the text
    generated so far (hold back a possible marker while ``final`` is false); whole and
    streamed ``reasoning_content`` are derived from it. ``start(prompt_tail)`` is called
    first with the end of the rendered prompt, and ``end_markers`` name the texts after
    which structured output applies. Most formats subclass ``ThinkTagReasoningParser``
    and set its markers. Selected by ``server.reasoning_parser`` (flag
    ``--reasoning-parser``; built in: ``"qwen3"``, ``"deepseek_r1"``, ``"granite"``,
    ``"mistral"``).
    """


# --- 2. Lifecycle observers -----------------------------------------------------------


@hookspec
def engine_started(config: EngineConfig, info: dict[str, Any]) -> None:
    """Called in the engine-core process once the engine is ready to serve.

    ``config`` is the resolved :class:`enginecore.config.EngineConfig`; ``info`` holds the
    facts only known after start-up: ``max_model_len``, ``num_blocks``, ``block_size`` and
    ``components`` (the selected name and providing plugin of each component kind).
    """


@hookspec
def worker_started(worker: Any) -> None:
    """Called inside each worker process after its model is loaded.

    ``worker`` is the :class:`enginecore.interfaces.Worker` (``worker.rank``,
    ``worker.model_runner``, ...). This is where a debugging plugin installs its own
    hooks in every rank.
    """


@hookspec
def request_finished(request_stats: Any) -> None:
    """Called in the frontend process once per finished request.

    ``request_stats`` is a :class:`enginecore.metrics.stats.FinishedRequestStats` with the
    request id, finish reason, token counts, timings and the user-supplied ``extra``
    metadata of the request.
    """


@hookspec
def engine_stopped(reason: str) -> None:
    """Called in the engine-core process when the engine shuts down.

    ``reason`` is ``"shutdown"`` for an orderly stop, or the text of the error that killed
    the engine.
    """
