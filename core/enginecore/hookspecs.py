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

    The engine builds the scheduler once the KV cache size is known, as ``cls(config,
    num_blocks=..., max_model_len=..., policy=..., kv_connector=..., log_stats=...)``; a
    scheduler that sets ``supports_kv_cache_groups`` is also given ``kv_cache_groups=``
    (each group's sliding window or None). Prove one with
    :class:`enginecore.testing.SchedulerContract`.

    Time limit: the scheduler runs in the engine loop, bounded by the step watchdog,
    ``engine.execute_timeout`` (300 s by default; in the engine's own process plus a
    5 s grace, in-process exactly). Past it every in-flight request fails with
    :class:`enginecore.errors.EngineDeadError` naming the plugin and the method found
    running, and the engine process exits. Building it counts against
    ``engine.ready_timeout`` (600 s).
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

    Built as ``cls(config)``, plus ``settings=`` when the plugin declares
    ``plugin_settings``. :class:`enginecore.testing.SchedulingPolicyContract` checks
    that fresh instances give the same order and the same admissions over 20 shuffles.
    Examples: ``plugins/enginecore-sjf`` and the fair-share policy in
    ``tests/plugins/enginecore-fair-share``.

    Time limit: ``sort_key``, ``admit`` and ``pick_preemption_victim`` run in the engine
    loop, bounded by ``engine.execute_timeout`` (300 s by default, plus a 5 s grace in
    the engine's own process); past it the engine is declared dead with an error naming
    the policy, its plugin, the method and ``scheduler.policy``, and its process exits.
    """


@hookspec
def register_executors(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.Executor` implementations.

    Selected by ``parallel.executor`` (flat name ``executor``). Built in: ``"uni"``,
    ``"mp"``, ``"ray"``, ``"external_launcher"``; ``"auto"`` picks ``uni`` for a world
    size of one and ``mp`` otherwise (and ``mp`` for one CPU rank with
    ``cpu_reserved_cores`` > 0, as under ``enginecore serve``).

    Built in the engine-core process as ``cls(config, worker_spec)``; the
    :class:`enginecore.interfaces.WorkerSpec` carries the ``module:attr`` references the
    workers import. Implement ``collective_rpc(method, timeout=None, args=(),
    kwargs=None, non_block=False, unique_reply_rank=None)`` (vLLM's argument order, as
    ``LLM.collective_rpc``: one result per rank in rank order, a rank's exception raised
    as :class:`enginecore.errors.RankError` with its rank, ``non_block`` returning a
    ``concurrent.futures.Future``, ``timeout`` honoured) and ``shutdown``; call
    ``self._report_failure(message)`` when a rank dies. Prove it with
    :class:`enginecore.testing.ExecutorContract` (``executor``: the name or the class;
    ``world_size``).

    A wrapping executor (``plugins/enginecore-echo-executor``) builds the inner one
    through the registry with the same arguments,
    ``make_plugin_manager(config.plugins.enabled,
    config.plugins.disabled).registry("executor").get("uni")(config, worker_spec)``,
    forwards ``collective_rpc`` and ``shutdown``, copies ``max_concurrent_batches`` and
    passes ``register_failure_callback`` through, so the engine's death chain still
    works. A ``wrapper=True`` implementation of this hook can register such a wrapper
    for every executor at once.

    Time limit: start-up (building the executor and its workers) is bounded by
    ``engine.ready_timeout`` (600 s by default); each step by ``engine.execute_timeout``
    (300 s; the ``mp`` executor's workers enforce it per rank and name the rank);
    ``collective_rpc`` by the call's ``timeout``. Past a step's limit in-flight requests
    fail, the engine is declared dead and its process exits.
    """


@hookspec
def register_model_runners(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.ModelRunner` implementations.

    Selected by ``model.runner`` (flat name ``runner``; default ``"torch"``). The runner is
    built inside each worker process.

    Built as ``cls(config, worker_spec, device, parallel)``. Prove one with
    :class:`enginecore.testing.ModelRunnerContract`.

    Time limit: ``load_model``, profiling and KV cache set-up count against
    ``engine.ready_timeout`` (600 s by default: start-up fails naming the runner); each
    ``execute_model`` / ``sample_tokens`` against ``engine.execute_timeout`` (300 s;
    past it the engine is declared dead naming the plugin and method found running).
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

    A model that cannot serve an option its checkpoint asks for raises
    :class:`enginecore.errors.UnsupportedModelError` (or ``NotImplementedError``) while
    it is built: the error names the architecture and reaches the user as it is.
    ``enginecore plugin new NAME --kind model`` writes a Llama-shaped model in this
    form; ``tests/plugins/enginecore-echo-model`` is a complete model plugin (a scripted
    ``EchoForCausalLM`` that keeps its context in the paged KV cache).

    Time limit: building the model and loading its weights count against
    ``engine.ready_timeout`` (600 s by default); a forward pass against
    ``engine.execute_timeout`` (300 s). An exception while the model is built fails
    start-up naming the architecture, its plugin and ``model.path``.
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
    soft-capping, CUDA graphs, the KV cache dtypes it keeps besides the model's for
    ``cache.kv_cache_dtype``: the cache it allocates is then of ``spec.cache_dtype``);
    ``enginecore plugins`` lists them.

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

    A backend names the block size it wants in ``default_block_size`` (16 unless it says
    otherwise; ``flash_attn`` 256). While ``cache.block_size`` is unset, each backend is
    judged at its own block size, and the engine, its scheduler and every rank take the
    chosen backend's; a block size the user sets is used as is, and a backend that
    cannot read it is passed over. Engines with a KV connector keep 16, so that they
    agree on their blocks.

    Built once per model runner as ``cls(spec)`` (an ``AttentionSpec``: this rank's
    heads, head size, dtype, device, block size, limits). It allocates the cache
    (``allocate_kv_cache(num_blocks)``, one tensor per layer), builds the step's
    metadata (``build_metadata(batch)``: request ids, query and context lengths, block
    table, slot mapping, decodes first) and, for each ``Attention`` layer, writes K/V
    and attends (``forward(layer, q, k, v, kv_cache, metadata)``). Optional:
    ``order_decodes`` (a backend with per-request state orders the decodes),
    ``workspace_bytes`` (memory beyond the cache, reserved by profiling),
    ``fused_ops()`` (an :class:`enginecore.layers.FusedOps` of fused norm, rotary,
    activation and argmax kernels), ``fused_decode(model, kv_caches)`` (an object with
    ``handles(batch)`` and ``run(input_ids, positions, batch)`` that computes a whole
    decode step in fewer calls than the model's layers; with ``has_head``, its
    ``run(..., head="logits" | "tokens")`` gives the logits or the greedy tokens too),
    ``lora_kernels()``,
    ``release_kv_cache()`` (sleep). The GPU runner captures decode steps in CUDA graphs
    only with a backend that declares them and keeps its metadata in persistent buffers.

    With sliding-window layers the cache is laid out in KV cache groups:
    ``spec.num_layers`` is then the number of cache tensors (layers of different groups
    share them) and ``spec.num_kv_cache_groups`` the number of groups;
    ``build_metadata`` is called once per group each step with that group's block table
    and slot mapping (``batch.kv_cache_group``), and each layer receives its own group's
    metadata (a backend that keeps metadata in persistent buffers needs one set per
    group). Block-table entries before a sliding layer's window are stale or block 0 and
    must stay masked. ``tests/plugins/enginecore-naive-attention`` is a complete
    third-party backend.

    Under ``"auto"`` a backend is passed over when its ``unsupported_reason(spec)``
    classmethod returns a reason (not None) for the model's device, dtype, head size,
    sliding window and soft-capping.

    Time limit: ``__init__`` and the profiling pass count against ``engine.ready_timeout``
    (600 s by default); ``build_metadata`` and ``forward`` run in each step, bounded by
    ``engine.execute_timeout`` (300 s; in the engine's own process plus a 5 s grace).
    Past it in-flight requests fail with an error naming the backend, its plugin,
    ``model.attention_backend`` and the method, and the engine process exits. A
    ``forward`` whose output does not have the query's shape and dtype fails the step
    naming the backend (checked once per new shape).
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

    Built once per runner as ``cls(config)``. Every linear layer calls
    ``create_weights(layer, input_size, output_size, dtype)`` in its constructor,
    ``process_weights_after_loading(layer)`` once the checkpoint is loaded and
    ``apply(layer, x, bias)`` every forward; a gated gate/up projection may be computed
    with its activation in ``apply_silu_and_mul``.

    Under ``"auto"`` a method is passed over when its ``unsupported_reason(device,
    dtype)`` classmethod returns a reason (not None).

    Time limit: weight preparation counts against ``engine.ready_timeout`` (600 s by
    default; reported after 30 s per layer, as above); ``apply`` runs in each step,
    bounded by ``engine.execute_timeout`` (300 s): past it the engine is declared dead
    naming the method, its plugin and ``model.linear_method``. An ``apply`` whose output
    has the wrong shape or dtype fails the step naming the method.
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

    Configured by ``kv_transfer.role`` and ``kv_transfer.extra_config``. A
    ``KVConnectorContract`` subclass sets ``connector`` and overrides
    ``producer_kv_transfer(tmp_path)`` to return the ``kv_transfer`` settings the
    connector needs.

    Time limit: the scheduler half runs in the engine loop and the worker half in each
    step, both bounded by ``engine.execute_timeout`` (300 s by default; in the engine's
    own process plus a 5 s grace): past it the engine is declared dead naming the
    plugin, the half and ``kv_transfer.connector``. An exception from the worker half
    fails only the requests its step's metadata names (error text naming the connector,
    its plugin and ``kv_transfer.connector``); ``worker_side`` raising fails start-up
    with the same names.
    """


@hookspec
def register_stat_loggers(registry: Registry[Any]) -> None:
    """Register :class:`enginecore.interfaces.StatLogger` implementations.

    Selected by the list ``observability.stat_loggers`` (built in: ``"logging"``,
    ``"prometheus"``). Stat loggers run in the frontend process and receive scheduler
    stats, iteration stats and per-finished-request stats.

    Built as ``cls(config, engine_index)`` (plus ``settings=`` when the plugin declares
    them); with data parallelism once per replica (``engine_index`` 0..N-1), each
    receiving only its replica's steps. ``LLM``, ``AsyncLLM``, ``enginecore generate``
    and ``enginecore serve`` call ``record()`` once per engine step, ``log()`` every
    ``observability.log_stats_interval`` seconds and the optional ``close()`` (release
    files and sockets) at shutdown. Prove one with
    :class:`enginecore.testing.StatLoggerContract`; example:
    ``plugins/enginecore-jsonl-stats``.

    Time limit: each call (``record``, ``log``, ``log_engine_initialized``, ``close``...)
    runs on the logger's own thread, bounded by ``engine.frontend_plugin_timeout`` (5 s
    by default). The step does not wait for ``record``: a logger still busy keeps at
    most 32 records waiting and later ones are dropped (and counted); a record that
    raised or runs past the limit is noticed at the logger's next call. The other
    calls are waited for, after the records handed over before them. A logger that
    raises or does not return in time is named once (its plugin and the method) and
    disabled; the other loggers keep logging and no client waits longer than the limit.
    """


@hookspec
def register_worker_rpcs(registry: Registry[Any]) -> None:
    """Register named functions callable on every worker through ``collective_rpc(name)``.

    The factory is a function ``fn(worker, *args, **kwargs)``; it runs inside each worker
    process with the :class:`enginecore.interfaces.Worker` as first argument, and its
    return value (which must be msgpack- or pickle-serialisable) is sent back per rank.

    Built in (for debugging; ``enginecore rpc NAME`` calls them on a running server):
    ``memory_snapshot``, ``kv_cache_stats``, ``model_summary``, ``lora_state`` (each
    rank's LoRA slots, host copies and reads) and ``trace_next_steps(n)``.
    Only names registered here can be called from outside (``enginecore rpc``,
    ``POST /collective_rpc``), never a Worker's own methods.

    Each call has a time limit: the call's ``timeout``, or ``engine.rpc_timeout``
    (60 s by default; ``enginecore rpc --timeout``). The function runs on a thread of
    its own in the worker, so past the limit the caller gets an error naming the RPC
    and the worker goes on serving; the stuck thread is abandoned, not stopped, so an
    RPC must not take locks the model's forward needs.

    A rank that raises makes the call raise :class:`enginecore.errors.RankError`
    (``.rank``, ``.method`` and the error's text) in every process mode. The worker
    attributes an RPC may rely on: ``config``, ``rank``, ``local_rank``, ``device``,
    ``parallel`` (``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``), ``model_runner``
    (the torch runner's ``model`` is the ``torch.nn.Module``) and ``plugin_host``;
    anything else on the worker is internal.
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

    Each request gets its own :class:`enginecore.interfaces.StructuredOutputGrammar`
    from ``new_grammar(compiled)``: ``accept_tokens(token_ids)`` (False: rejected, state
    unchanged), ``rollback(num_tokens)``, ``fill_bitmask(bitmask, row)`` (int32 words;
    bit j of word w allows token 32*w+j) and ``is_terminated()``. A
    ``StructuredOutputParams`` carries exactly one of ``json``, ``json_object``,
    ``regex``, ``choice``, ``grammar`` and ``structural_tag``; ``validate`` refuses the
    kinds a backend does not support by raising
    :class:`enginecore.errors.InvalidRequestError` (a 400 with its message).

    How the engine drives every backend: ``validate(spec)`` runs in the frontend before
    the request is queued. ``compile(spec)`` runs on a thread pool in the engine core,
    cached by the constraint's kind and text (a JSON schema by its key-sorted text);
    until it is ready the request waits as ``WAITING_FOR_GRAMMAR`` outside the
    scheduler, so any scheduler works unchanged, and a compile error finishes only that
    request (``finish_reason`` ``"error"``). Each step, while the forward pass runs, the
    engine fills one bitmask for the batch (int32 ``[rows, ceil(vocab_size / 32)]``: a
    row per structured request, plus one per draft token under speculative decoding,
    filled after accepting the drafts before it and rolled back after) and the runner
    masks the logits with it; ``vocab_size`` is the model's, so ids the tokenizer lacks
    are never allowed. After the step ``accept_tokens`` advances each grammar by the
    tokens its request sampled. Once ``is_terminated()`` (the grammar accepted a stop
    token) the request finishes with ``stop``, also under ``ignore_eos``: tokens sampled
    after the end are dropped and never fed to the grammar. With async scheduling, a
    batch whose structured requests wait for a token still in flight runs its forward
    pass at once and samples once that token has advanced the grammar. ``tests/helpers/token_trie_backend.py`` is a
    complete second backend.

    Constraints come from ``SamplingParams(structured_output=...)`` and the server's
    ``response_format`` and ``guided_*`` fields; a ``backend`` name nobody registered
    fails at start-up with the list of registered backends.

    Time limit: ``validate`` runs in the frontend and ``compile`` on the engine's compile
    threads, off the engine loop (a compile that never returns holds only the requests
    waiting for that grammar, which a client may abort); a compile error fails the
    request naming a plugin's backend and ``structured_output.backend``.
    ``fill_bitmask``, ``accept_tokens`` and ``rollback`` run in each step, bounded by
    ``engine.execute_timeout`` (300 s by default; past it the engine is declared dead
    naming the plugin and the method). A grammar that is not terminated must allow at
    least one token: a row ``fill_bitmask`` leaves empty fails that request naming the
    plugin and ``fill_bitmask`` (the row is not used).
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

    Example: ``plugins/enginecore-cycle-proposer``; prove one with
    :class:`enginecore.testing.SpecDecodeProposerContract`.

    Time limit: ``propose`` runs in each step on the worker, bounded by
    ``engine.execute_timeout`` (300 s by default; past it the engine is declared dead
    naming the plugin and the method); a proposer that raises in ``__init__`` fails
    start-up naming it, its plugin and ``speculative.speculative_method``. ``propose``
    must return at most ``max_num_drafts`` integer token ids of the model's vocabulary
    (``0 <= id < vocab_size``; a list, tuple or 1-D integer array); anything else fails
    that request only, with a :class:`enginecore.errors.PluginContractError` message
    naming ``propose``, what was wrong and ``speculative.speculative_method`` (the
    tokens the request already had are kept; the other requests run on). An exception
    raised in ``propose`` itself kills the engine.
    """


@hookspec
def register_tool_parsers(registry: Registry[Any]) -> None:
    """Register tool-call parsers for ``/v1/chat/completions`` by name.

    The factory is called as ``factory(tokenizer)`` once per request and returns an
    :class:`enginecore.tool_parsers.ToolParser` (implement its ``parse(text,
    final)``; whole and streamed tool calls are derived from it). Selected by
    ``server.tool_call_parser`` (flag ``--tool-call-parser``; built in: ``"hermes"``,
    ``"llama3_json"``, ``"mistral"``, ``"pythonic"``, ``"qwen3_coder"``).

    ``parse(text, final)`` returns a ``ParsedText``: the content so far (holding back
    text that may begin a tool-call marker while ``final`` is false) and a
    ``PartialToolCall(name, arguments)`` per call seen so far, the name only once it is
    complete, the arguments a prefix of their final raw JSON text, ``invalid=True`` for
    a finished call that does not parse. Parsing is on with
    ``server.enable_auto_tool_choice``. Before the first ``parse`` the server sets
    ``parser.tools`` to the request's ``tools`` (formats that write arguments as text
    convert them by their JSON schema); override ``new_call_id()`` where a model family
    expects its own id shape; ``keeps_special_tokens = True`` asks for the reply
    detokenized with its special tokens, where the format's markers are special tokens
    (the EOS that ends the reply is still left out). Prove one with
    :class:`enginecore.testing.ToolParserContract`; ``enginecore plugin new NAME --kind
    tool-parser`` starts a package.

    The server derives the whole response (``message.tool_calls``, ``finish_reason:
    "tool_calls"``) and the streamed deltas (id and name first, then argument fragments)
    from ``parse``, so they always agree. Mistral's ``[TOOL_CALLS]`` is a marker that is
    a special token.

    Time limit: the factory and each ``parse`` run on a thread of the request's own,
    bounded by ``engine.frontend_plugin_timeout`` (5 s by default). A parser that raises
    or does not return in time fails that request alone with a 500 naming the parser,
    its plugin, ``server.tool_call_parser`` and the method; other requests keep being
    served (the server waits for parsers off its event loop). At most 4 of a parser's
    calls past the limit are left running; while that many run, requests that need the
    parser are refused with a 503 naming it.
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

    The chat reply's ``reasoning_content`` and ``reasoning`` (vLLM's newer name; both
    are sent), its streamed deltas and the Responses API's ``reasoning`` items all
    derive from ``parse``, and tool-call parsing reads only the content.
    ``start(prompt_tail)`` tells a parser that the chat template opened the think block
    itself (DeepSeek-R1, Qwen3-Thinking) or closed it (``enable_thinking: false``).
    ``keeps_special_tokens = True`` asks for the reply with its special tokens, for
    markers that are special tokens (Magistral's ``[THINK]``). A
    ``ThinkTagReasoningParser`` subclass sets ``start_markers``, ``end_markers`` and
    ``untagged_is_reasoning`` (whether output with no opening marker is reasoning until
    the end marker, or all content). Prove one with
    :class:`enginecore.testing.ReasoningParserContract`; ``enginecore plugin new NAME
    --kind reasoning-parser`` starts a package.

    Time limit: the factory, ``start``, each ``parse`` and ``extract_reasoning`` (the
    whole reply's split) run on a thread of the request's own, bounded by
    ``engine.frontend_plugin_timeout`` (5 s by default). A parser that raises or does
    not return in time fails that request alone with a 500 (an ``error`` event once a
    stream has begun) naming the parser, its plugin, ``server.reasoning_parser`` and
    the method; other
    requests keep being served (the server waits for parsers off its event loop). At
    most 4 of a parser's calls past the limit are left running; while that many run,
    requests that need the parser are refused with a 503 naming it.
    """


# --- 2. Lifecycle observers -----------------------------------------------------------


@hookspec
def engine_started(config: EngineConfig, info: dict[str, Any]) -> None:
    """Called in the engine-core process once the engine is ready to serve.

    ``config`` is the resolved :class:`enginecore.config.EngineConfig`; ``info`` holds the
    facts only known after start-up: ``max_model_len``, ``num_blocks``, ``block_size`` and
    ``components`` (the selected name and providing plugin of each component kind).

    ``info`` also holds ``startup_seconds``; ``components`` maps each kind to ``"name
    (from plugin)"``. An exception raised in any lifecycle observer is logged as
    ``plugin 'x' raised in engine_started (ignored)``.
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

    Called alike under ``LLM``, ``AsyncLLM``, ``enginecore generate`` and ``enginecore
    serve``, for aborted requests too. The fields: ``request_id``, ``finish_reason``
    (``"stop"``, ``"length"``, ``"abort"`` or ``"error"``), ``num_prompt_tokens``,
    ``num_generation_tokens``, ``e2e_latency``, ``queued_time``, ``prefill_time``,
    ``inference_time``, ``decode_time``, ``ttft``, ``mean_tpot`` (seconds),
    ``num_cached_tokens``, ``num_preemptions``, ``max_tokens_param`` and ``extra`` (the
    request's ``SamplingParams(extra={...})``, passed through untouched). Use it for
    billing or audit logs; use a stat logger for aggregate metrics.
    """


@hookspec
def engine_stopped(reason: str) -> None:
    """Called in the engine-core process when the engine shuts down.

    ``reason`` is ``"shutdown"`` for an orderly stop, or the text of the error that killed
    the engine.

    For example ``"EngineDeadError: executor failed: ..."``.
    """
