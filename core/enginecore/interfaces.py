"""The abstract classes a plugin implements. Part of the versioned public API.

Each ABC lists what the engine relies on. ``enginecore.testing`` ships a contract test
suite per ABC that a plugin author runs against their class.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import msgspec

if TYPE_CHECKING:
    import numpy as np

    from enginecore.config import EngineConfig
    from enginecore.kv_aggregation import KVOutputAggregator
    from enginecore.params import StructuredOutputParams
    from enginecore.protocol import EngineCoreOutputs, SchedulerStats
    from enginecore.request import Request, RequestStatus
    from enginecore.runner_output import KVConnectorOutput, ModelRunnerOutput
    from enginecore.scheduler_output import GrammarOutput, SchedulerOutput


# --- scheduling ----------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerState:
    """A read-only view of the scheduler that a policy may consult in ``admit``.

    ``running`` and ``waiting`` are the scheduler's own requests (no copy, so building
    the state costs nothing): read ``request.extra`` (the user's ``SamplingParams.extra``,
    e.g. a tenant), ``priority``, ``num_prompt_tokens``, ``num_computed_tokens``,
    ``max_tokens`` and ``seq_no``, and never change them. ``waiting`` holds the requests
    still queued (the one being decided included) in no particular order. A fair-share policy counts each
    tenant's running requests here instead of keeping state of its own.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    token_budget_left: int
    step: int
    running: Sequence[Request] = ()
    waiting: Sequence[Request] = ()


class SchedulingPolicy(ABC):
    """Order, admission and preemption choices, without subclassing the scheduler.

    Policies are small and pure: the scheduler owns all state and calls these methods,
    and the same arguments give the same answer from any instance (the conformance kit
    checks this across fresh instances). What a policy needs to know about the other
    requests is in the :class:`SchedulerState` that ``admit`` receives.
    Async scheduling, chunked prefill and prefix caching work whatever policy is chosen.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def sort_key(self, request: Request) -> Any:
        """Key of the waiting queue: the request with the smallest key is admitted first.

        Must be deterministic (use ``request.seq_no``, never wall-clock time) so that
        identical engines make identical decisions.
        """

    def admit(self, request: Request, state: SchedulerState) -> bool:
        """Whether ``request`` (the next in order) may be admitted this step."""
        return True

    def pick_preemption_victim(self, running: Sequence[Request]) -> Request:
        """Which running request to preempt when the KV cache is full.

        The default preempts the request that sorts last (the newest under FCFS).
        """
        return max(running, key=self.sort_key)

    def client_key(self, request: Request) -> Hashable:
        """Which client ``request`` belongs to, for the per-client cap on requests in one
        step (``scheduler.max_num_seqs_per_client``, applied while more than one client
        has unfinished requests). Called once per request, when it is added.

        The default reads ``client`` in ``SamplingParams.extra``, which ``enginecore
        serve`` sets to the client's address; requests without one (offline ``LLM`` use)
        are one client. Override to group by tenant, API key or adapter instead.
        """
        return (request.extra or {}).get("client")


class Scheduler(ABC):
    """Decides, each step, how many tokens of which requests run.

    Constructed by the engine as ``cls(config, num_blocks=..., max_model_len=...,
    policy=..., kv_connector=...)`` once the KV cache size is known (plus
    ``kv_cache_groups=...`` where ``supports_kv_cache_groups`` is set and the model has
    sliding-window layers).
    """

    #: Whether this scheduler supports async scheduling (placeholders for tokens not yet
    #: sampled, so ``schedule`` may run again before ``update_from_output``).
    supports_async_scheduling: ClassVar[bool] = False
    #: Whether this scheduler manages KV cache groups: then, for a model with sliding
    #: window layers, it is also constructed with ``kv_cache_groups=`` (each group's
    #: window, None for full attention) and sends per-group block ids.
    supports_kv_cache_groups: ClassVar[bool] = False
    #: Set by the engine when whoever reads its outputs takes plain steps as columns:
    #: ``update_from_output`` may then report a request's plain step (one token that
    #: finishes nothing and is not its first; no logprobs, events or other payload) in
    #: ``EngineCoreOutputs.plain_req_ids`` / ``plain_token_ids`` rather than as an
    #: ``EngineCoreOutput``. A scheduler may ignore it.
    plain_output_columns: bool = False

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        """Finish requests from outside (abort, stop string); ``None`` means all.

        Unknown or already-finished ids are ignored. Returns the requests finished now.
        Their blocks are freed and their ids reach the workers in the next
        ``SchedulerOutput.finished_req_ids``.
        """

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget and ``max_num_seqs``."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply sampled tokens, check stop conditions, free finished requests.

        Returns the outputs of this step per client index.
        """

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Finished requests whose ids the workers have not been told yet."""

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (and nothing done) while blocks are in use."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats | None:
        """Stats of the last step, or None when stats are off."""

    def shutdown(self) -> None:
        return None


# --- execution -----------------------------------------------------------------------


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What a worker process needs to build itself: resolved ``module:attr`` references.

    Registries are built once, in the process that reads the config; workers import only
    the components that were selected.
    """

    worker_ref: str
    model_runner_ref: str
    model_refs: dict[str, str]  # architecture name -> ref
    worker_rpc_refs: dict[str, str] = {}
    kv_connector_ref: str | None = None
    enabled_plugins: list[str] | None = None
    disabled_plugins: list[str] = []
    spec_decode_proposer_ref: str | None = None  # the selected draft proposer, if any
    # Name -> ref of every registered attention backend and linear method: "auto" is
    # resolved in the worker, which knows the device, dtype and model.
    attention_backend_refs: dict[str, str] = {}
    linear_method_refs: dict[str, str] = {}


FailureCallback = Callable[[str], None]


def map_future(future: Future[Any], fn: Callable[[Any], Any]) -> Future[Any]:
    """A Future of ``fn(result)``, or of the same exception."""
    mapped: Future[Any] = Future()

    def done(source: Future[Any]) -> None:
        try:
            value = fn(source.result())
        except BaseException as exc:
            mapped.set_exception(exc)
        else:
            mapped.set_result(value)

    future.add_done_callback(done)
    return mapped


class Executor(ABC):
    """The boundary between the one scheduler and the N ranks that run the model.

    ``collective_rpc`` is the one primitive; the other methods have defaults built on it.
    """

    #: How many batches may be in flight at once (2 enables async scheduling).
    max_concurrent_batches: int = 1
    #: Whether the step's results come from every rank of the world (so a KV connector's
    #: finished transfers are gathered across ranks); False for an executor that holds
    #: only its own rank, each with its own scheduler (``external_launcher``).
    gathers_all_ranks: bool = True

    def __init__(self, config: EngineConfig, worker_spec: WorkerSpec) -> None:
        self.config = config
        self.worker_spec = worker_spec
        self._failure_callbacks: list[FailureCallback] = []
        self.is_sleeping = False

    @property
    def output_rank(self) -> int:
        """The rank whose ModelRunnerOutput the engine uses (TP rank 0 of the last PP stage)."""
        par = self.config.parallel
        return (par.pipeline_parallel_size - 1) * par.tensor_parallel_size

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call ``method`` on every rank; one result per rank (or only ``unique_reply_rank``'s).

        ``method`` is a Worker method name, a name registered by ``register_worker_rpcs``,
        or a callable run as ``fn(worker, *args, **kwargs)``. A rank that raises makes the
        call raise an error that names the rank. ``non_block`` returns a Future.
        """

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[Any]: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = ...
    ) -> ModelRunnerOutput | None: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[Any] | None:
        output: ModelRunnerOutput | Future[Any] | None = self._step_call(
            "execute_model", scheduler_output, non_block
        )
        return output

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[True]
    ) -> Future[Any]: ...

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[False] = ...
    ) -> ModelRunnerOutput: ...

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[Any]:
        output: ModelRunnerOutput | Future[Any] = self._step_call(
            "sample_tokens", grammar_output, non_block
        )
        return output

    def _launch_step(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> tuple[Future[Any], Future[Any]]:
        """A step's ``execute_model`` and ``sample_tokens``, launched without blocking:
        their two futures. The step's output is the first's result where not None, else
        the second's. A built-in executor may run both as one call on its workers (one
        hand-off per step instead of two) and give that call's future for both. Not part
        of the plugin API: a plugin's executor defines the two halves."""
        execute: Future[Any] = self.execute_model(scheduler_output, non_block=True)
        sample: Future[Any] = self.sample_tokens(grammar_output, non_block=True)
        return execute, sample

    @functools.cached_property
    def kv_output_aggregator(self) -> KVOutputAggregator | None:
        """With a KV connector on several ranks: folds every rank's finished transfers
        into the output rank's output (:class:`enginecore.kv_aggregation.KVOutputAggregator`)."""
        world = self.config.parallel.world_size
        if world > 1 and self.config.kv_transfer.connector and self.gathers_all_ranks:
            from enginecore.kv_aggregation import KVOutputAggregator

            return KVOutputAggregator(world)
        return None

    def _step_call(self, method: str, arg: Any, non_block: bool) -> Any:
        aggregator = self.kv_output_aggregator
        if aggregator is None:
            return self.collective_rpc(
                method, args=(arg,), non_block=non_block, unique_reply_rank=self.output_rank
            )
        result = self.collective_rpc(method, args=(arg,), non_block=non_block)

        def fold(outputs: list[ModelRunnerOutput]) -> Any:
            return aggregator.merge_outputs(outputs, self.output_rank)

        if not non_block:
            return fold(result)
        return map_future(result, fold)

    def determine_available_memory(self) -> list[int]:
        """Bytes each rank can give the KV cache (after a profiling forward pass)."""
        available: list[int] = self.collective_rpc("determine_available_memory")
        return available

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes on the rank that needs the most."""
        block_bytes: list[int] = self.collective_rpc("get_kv_cache_block_bytes")
        return max(block_bytes)

    def get_max_model_len(self) -> int:
        max_model_len: int = self.collective_rpc("get_max_model_len", unique_reply_rank=0)
        return max_model_len

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", args=(num_blocks,))

    def sleep(self, level: int = 1) -> None:
        self.collective_rpc("sleep", args=(level,))
        self.is_sleeping = True

    def wake_up(self) -> None:
        self.collective_rpc("wake_up")
        self.is_sleeping = False

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """``callback(message)`` is called once if a rank dies; the message names the rank."""
        self._failure_callbacks.append(callback)

    def _report_failure(self, message: str) -> None:
        callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            callback(message)

    @abstractmethod
    def shutdown(self) -> None: ...


class Worker(ABC):
    """One rank: owns the device, the distributed group and the model runner."""

    rank: int
    local_rank: int
    model_runner: ModelRunner

    @abstractmethod
    def init_device(self) -> None: ...

    @abstractmethod
    def load_model(self) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None: ...

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput: ...


class ModelRunner(ABC):
    """Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

    Constructed in the worker as ``cls(config, worker_spec, device, parallel)``.
    """

    @abstractmethod
    def load_model(self) -> None:
        """Load weights (the checkpoint named by ``config.model.path``)."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Run a profiling forward at the largest batch; return bytes free for KV cache."""

    @abstractmethod
    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes on this rank (all layers, K and V)."""

    @abstractmethod
    def get_max_model_len(self) -> int:
        """The effective max_model_len (config value, else the checkpoint's)."""

    def get_kv_cache_groups(self, allow_hybrid: bool = True) -> list[int | None] | None:
        """Group the attention layers for the KV cache; called once, before sizing it.

        Returns the sliding window of each group (None: full attention), in the order
        of the scheduler's per-group block ids (``NewRequestData.group_block_ids``), or
        None for one group that keeps every position (the default). With
        ``allow_hybrid`` False the runner must keep one group: the scheduler or a KV
        connector manages a single block table.
        """
        return None

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the forward pass. Returns None: the engine then calls ``sample_tokens``."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample from the logits of the last ``execute_model`` (with a grammar bitmask)."""


# --- speculative decoding ------------------------------------------------------------


class SpecDecodeProposer(ABC):
    """Proposes draft tokens that the target model verifies in one forward pass.

    Registered with ``register_spec_decode_proposers`` and selected by
    ``speculative.speculative_method``. Built in each worker as ``cls(config)``, where it
    runs right after sampling, once per request that sampled. Drafts are checked against
    the target model's own samples, so whatever a proposer returns, the output is
    exactly what decoding without speculation would produce (same distribution; the
    same tokens for greedy and seeded requests): a proposer only decides the speed.

    A proposer must be deterministic given its input: with tensor or pipeline
    parallelism every rank proposes for itself and all must agree.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def propose(self, token_ids: np.ndarray, max_num_drafts: int) -> Sequence[int]:
        """Up to ``max_num_drafts`` tokens guessed to follow ``token_ids``.

        ``token_ids`` is the request's prompt and output so far (a read-only int64
        array; do not keep it). Return fewer tokens, or none, when there is no good
        guess: an empty proposal costs nothing.
        """


# --- KV connectors -------------------------------------------------------------------


class KVConnectorScheduler(ABC):
    """The scheduler-side half of a KV connector (runs in the engine core).

    Life of a request with external KV: ``get_num_new_matched_tokens`` (possibly asked
    again on later steps) -> blocks allocated -> ``update_state_after_alloc`` ->
    per step ``build_connector_meta`` tells the worker half what to load and save ->
    ``request_finished`` once, when the request finishes. A request whose load is
    asynchronous waits in status ``WAITING_FOR_REMOTE_KVS`` (holding its blocks, never
    blocking the loop) until the worker half reports it in ``finished_recving``.
    """

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Extra prompt tokens the connector can provide beyond the local prefix hit.

        ``num_computed_tokens`` is the local prefix-cache hit (block aligned). Returns
        ``(num_tokens, load_is_async)``: ``None`` tokens means "ask again later";
        ``load_is_async`` parks the request in ``WAITING_FOR_REMOTE_KVS`` until its load
        is reported finished. The engine caps the total so that the prompt's last token
        is always computed. Must have no side effects: it may be called repeatedly.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Called once per admission, after blocks were allocated for the request.

        ``block_ids`` are all the request's blocks; the first
        ``request.num_computed_tokens`` tokens are the local prefix hit and the next
        ``num_external_tokens`` are the ones the connector must load into the following
        blocks (0: nothing to load, but the connector may still want to save).
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """The opaque per-step metadata the worker half receives (msgspec/cloudpickle
        serializable). Called once per step, after the step's counters advanced.

        Optional attributes ``load_request_ids`` / ``save_request_ids`` (sets of ids)
        let the engine fail exactly the affected requests when the worker half raises
        while loading / saving; without them every request of the step is failed.
        """

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes (or is aborted or fails).

        Returns ``(delay_free, kv_transfer_params)``. ``delay_free=True`` keeps the
        blocks until the worker half reports the id in ``finished_sending`` (a save or a
        send still reads them). ``kv_transfer_params`` travel back to the client in the
        final output (disaggregated prefill hands the decode instance its handle so).
        """

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """What the worker halves reported this step (finished and failed transfers)."""

    def shutdown(self) -> None:  # noqa: B027
        """Release sockets, threads and files (engine shutdown)."""


class KVConnectorWorker(ABC):
    """The worker-side half of a KV connector (runs inside the forward pass).

    Per step: ``start_load_kv(metadata)`` before the forward, ``wait_for_layer_load`` /
    ``save_kv_layer`` around each attention layer, ``wait_for_save`` after the forward,
    then ``get_finished``. Layers are named ``"layer.<i>"`` (``i`` the layer index on
    this rank) and their cache tensors are ``[2, num_blocks, block_size, kv_heads,
    head_dim]`` (K then V); ``register_kv_caches`` hands them over once.
    """

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Start the loads this step's metadata asks for (may return before they end)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer's synchronous loads are in the cache."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: Any) -> None:
        """This layer's cache now holds the step's K/V: start saving what is due."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward pass: the cache may be overwritten from the next step on,
        so anything saves still need must have been copied out by now."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` request ids, each reported exactly once.

        ``finished_req_ids`` are the requests the scheduler finished since the last
        step: a request whose blocks were kept (``delay_free``) must eventually appear
        in ``done_sending``; an asynchronous load must eventually appear in
        ``done_recving`` (also when it failed).
        """

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose loaded contents are invalid (missing, truncated, bad checksum)
        since the last call: the engine recomputes them and never uses their contents."""
        return set()

    def get_failures(self) -> dict[str, str]:
        """Requests whose load or save failed since the last call: id -> error text.
        The engine finishes each with an error and frees its blocks."""
        return {}

    def get_num_rejected_messages(self) -> int:
        """Malformed or refused messages the connector's servers received from peers
        since the last call (the ``kv_connector_rejected_messages`` metric)."""
        return 0

    def check_health(self) -> None:  # noqa: B027
        """Raise (with the reason) when a thread or socket the connector needs has died:
        the engine's health check (``/health``) then answers 503. Must be cheap."""

    def shutdown(self) -> None:  # noqa: B027
        """Release sockets, threads and files (worker shutdown)."""


class KVConnectorFactory(ABC):
    """What ``register_kv_connectors`` registers: builds the two halves of a connector.

    ``scheduler_side`` runs in the engine core process, ``worker_side`` in each worker
    (``rank`` is the global rank). Both read ``config.kv_transfer`` (``role``,
    ``extra_config``).

    ``transfer_params_type`` declares the ``kv_transfer_params`` a request may carry (a
    :class:`msgspec.Struct`): the frontend converts every request's params to it and
    answers a mismatch with a 400 naming the field, so the scheduler half only ever sees
    params of that shape. ``None`` (the default) checks nothing.
    """

    transfer_params_type: ClassVar[type[Any] | None] = None

    def check_transfer_params(self, config: EngineConfig, params: Any) -> None:
        """Frontend checks that depend on the configuration, on params already converted
        to ``transfer_params_type`` (e.g. a peer the instance was not configured with).
        Raise :class:`ValueError` with the reason; the client gets a 400."""
        return None

    @abstractmethod
    def scheduler_side(self, config: EngineConfig) -> KVConnectorScheduler: ...

    @abstractmethod
    def worker_side(self, config: EngineConfig, rank: int) -> KVConnectorWorker: ...


# --- structured output ---------------------------------------------------------------


class StructuredOutputGrammar(ABC):
    """One request's grammar state: which tokens may come next.

    Made by :meth:`StructuredOutputBackend.new_grammar`, one per request, and used only
    from the engine loop thread (never concurrently).
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids`` in order.

        Returns False when one is not allowed; the state is then as before the call
        (tokens accepted before the rejected one are rolled back).
        """

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (draft tokens for speculative decoding)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``.

        ``bitmask`` is int32 ``[rows, ceil(vocab_size / 32)]``; bit ``j`` of word ``w``
        allows token ``32 * w + j``. The row comes in with every bit set.
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete (the engine
        finishes the request with ``stop`` and feeds this grammar nothing more)."""


class StructuredOutputBackend(ABC):
    """Compiles constraints (:class:`enginecore.StructuredOutputParams`) into grammars.

    Registered with ``register_structured_output_backends`` and selected by
    ``structured_output.backend``. Built in the engine-core process, the first time a
    request needs it, as ``cls(config, tokenizer=..., vocab_size=..., eos_token_ids=...)``:
    ``tokenizer`` is the model's transformers tokenizer and ``vocab_size`` the model's
    (which may exceed the tokenizer's; tokens past the tokenizer are never allowed).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    def validate(cls, spec: StructuredOutputParams) -> None:
        """Check a constraint in the frontend, before the request is queued (no tokenizer).

        Raise :class:`enginecore.errors.InvalidRequestError` with the compiler's message
        (the HTTP server answers 400). The default accepts everything; errors then come
        from :meth:`compile` and finish the request with an error.
        """
        return None

    @abstractmethod
    def compile(self, spec: StructuredOutputParams) -> Any:
        """Compile a constraint (slow: called from a thread pool, so it must be thread-safe).

        The result is opaque to the engine, which caches it by the constraint's text and
        passes it to :meth:`new_grammar`. Raise ``InvalidRequestError`` for a bad constraint.
        """

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh grammar at its start state for one request (fast)."""

    def shutdown(self) -> None:
        return None


# --- observability -------------------------------------------------------------------


@dataclass
class IterationStats:
    """Built in the frontend from one step's outputs."""

    timestamp: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[Any] = field(default_factory=list)  # FinishedRequestStats
    # One entry per user request whose last sample finished this step: its ``n`` and the
    # most tokens any of its samples generated.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


class StatLogger(ABC):
    """Receives engine statistics in the frontend. Constructed as ``cls(config, engine_index)``.

    Loggers are built before the engine starts (so that a bad one fails in seconds); the
    frontend sets :attr:`max_model_len` and :attr:`num_kv_blocks` to the engine's resolved
    values before it calls :meth:`log_engine_initialized`.
    """

    max_model_len: int | None = None
    num_kv_blocks: int | None = None

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index

    @abstractmethod
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Called once per engine step with that step's stats."""

    def log_engine_initialized(self) -> None:
        return None

    def log(self) -> None:
        """Called periodically (``observability.log_stats_interval``)."""
        return None

    def record_sleep_state(self, asleep: bool, level: int = 0) -> None:
        """Called when the engine falls asleep (at ``level`` 0, 1 or 2) or wakes up."""
        return None

    def record_admission_rejection(self, reason: str) -> None:
        """Called when the server refuses a request before it reaches the engine
        (``"max_num_queued_reqs"``: its queue is full)."""
        return None


# --- attention backends and linear methods ----------------------------------------------


@dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention needs, and where it runs: the facts a backend is chosen
    by and built from (this rank's heads)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype of the KV cache and activations
    device: Any  # torch.device
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    sliding_window: bool = False  # some layer has a window
    # KV cache groups (sliding and full layers with their own block tables): with more
    # than one, layers of different groups share cache tensors and the runner builds
    # metadata per group (AttentionBatch.kv_cache_group).
    num_kv_cache_groups: int = 1
    logits_soft_cap: bool = False  # some layer caps its scores
    # torch.dtype the KV cache is kept in where it differs from ``dtype``
    # (``cache.kv_cache_dtype``); None: ``dtype``.
    kv_dtype: Any = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def cache_dtype(self) -> Any:
        """The torch.dtype of the KV cache."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def cache_dtype_name(self) -> str:
        return str(self.cache_dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend supports; ``enginecore plugins`` shows it and ``auto`` selection
    reads it. ``head_sizes=None`` means any."""

    devices: tuple[str, ...]
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    head_sizes: tuple[int, ...] | None = None
    sliding_window: bool = True
    logits_soft_cap: bool = True
    cuda_graphs: bool = False
    # KV cache dtypes kept other than the model's dtype (``cache.kv_cache_dtype``): the
    # backend's writes round K/V to them and its reads widen them back.
    kv_cache_dtypes: tuple[str, ...] = ()

    def kv_cache_reason(self, spec: AttentionSpec) -> str | None:
        """Why a KV cache of ``spec.cache_dtype`` cannot be kept (None: it can)."""
        kv = spec.cache_dtype_name
        if kv == spec.dtype_name or kv in self.kv_cache_dtypes:
            return None
        others = "".join(f" or {d}" for d in self.kv_cache_dtypes)
        return (
            f"keeps the KV cache in the model's dtype ({spec.dtype_name}){others}, "
            f"not {kv} (kv_cache_dtype)"
        )

    def describe(self) -> str:
        heads = "any" if self.head_sizes is None else _compact(self.head_sizes)
        extras = [
            name
            for name, on in (
                ("sliding window", self.sliding_window),
                ("soft-cap", self.logits_soft_cap),
                ("CUDA graphs", self.cuda_graphs),
            )
            if on
        ]
        kv = "/".join(("auto", *self.kv_cache_dtypes))
        return (
            f"devices {'/'.join(self.devices)}; dtypes {'/'.join(self.dtypes)}; "
            f"KV cache {kv}; head sizes {heads}" + (f"; {', '.join(extras)}" if extras else "")
        )


def _compact(values: tuple[int, ...]) -> str:
    """``8-256 step 8`` for an evenly spaced run of sizes, else the list."""
    steps = {b - a for a, b in itertools.pairwise(values)}
    if len(values) > 4 and len(steps) == 1:
        return f"{values[0]}-{values[-1]} step {steps.pop()}"
    return ",".join(map(str, values))


class AttentionBackend(ABC):
    """Owns the KV cache layout and computes attention for mixed batches.

    Built once per model runner as ``cls(spec)`` (an :class:`AttentionSpec`). Each step
    the runner calls :meth:`build_metadata` once with the step's
    :class:`enginecore.layers.AttentionBatch`; every :class:`enginecore.layers.Attention`
    layer then calls :meth:`forward`, which writes the step's K/V into the paged cache and
    attends: prefills with and without context, decodes and speculative verification
    (several query tokens after a context) all arrive in one batch.

    Registered through ``register_attention_backends``; selected by
    ``model.attention_backend`` (``"auto"``: the supporting backend with the highest
    ``priority``). Test one with :class:`enginecore.testing.AttentionBackendContract`.
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(devices=("cpu",))
    #: ``auto`` prefers the supporting backend with the highest priority.
    priority: ClassVar[int] = 0
    #: Tokens per KV block this backend is given where ``cache.block_size`` is unset
    #: (a backend that reads only some page sizes names one it reads).
    default_block_size: ClassVar[int] = 16

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, *, by_name: bool = False) -> str | None:
        """Why this backend cannot serve ``spec`` (None: it can). ``by_name`` is True
        when the user selected it explicitly (a backend may allow more then, such as an
        interpreter on CPU). Checks the declared capabilities; override to add more."""
        caps = cls.capabilities
        device = getattr(spec.device, "type", str(spec.device))
        if device not in caps.devices:
            return f"runs on {'/'.join(caps.devices)}, not {device}"
        if spec.dtype_name not in caps.dtypes:
            return f"supports {'/'.join(caps.dtypes)}, not {spec.dtype_name}"
        kv_reason = caps.kv_cache_reason(spec)
        if kv_reason is not None:
            return kv_reason
        if caps.head_sizes is not None and spec.head_dim not in caps.head_sizes:
            return f"supports head sizes {caps.head_sizes}, not {spec.head_dim}"
        if spec.sliding_window and not caps.sliding_window:
            return "does not support sliding-window attention"
        if spec.logits_soft_cap and not caps.logits_soft_cap:
            return "does not support logit soft-capping"
        return None

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache; the default is ``[2, blocks, block_size, kv_heads, head_dim]``
        (K then V), which KV connectors and the built-in backends share."""
        s = self.spec
        return (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> list[Any]:
        """One zeroed cache tensor per layer."""
        import torch

        shape = self.kv_cache_shape(num_blocks)
        return [
            torch.zeros(shape, dtype=self.spec.cache_dtype, device=self.spec.device)
            for _ in range(self.spec.num_layers)
        ]

    def release_kv_cache(self) -> None:
        """The runner dropped the cache (sleep): drop whatever was derived from it."""
        return None

    def workspace_bytes(self) -> int:
        """Device memory attention takes beyond the cache at the largest step (the
        runner reserves it before sizing the cache)."""
        return 0

    def order_decodes(self, req_ids: list[str], batch_view: Any) -> list[str]:
        """The order the step's decode requests should take in the batch (a backend with
        per-request state, like a dense decode mirror, may want its own). ``batch_view``
        maps a request id to ``(context_len, block_ids)``; the model runner's view also
        has ``context_lens_array(req_ids)``, the context lengths as one int64 array. In
        steady decoding the runner passes back the order this returned for the last
        step."""
        return req_ids

    @abstractmethod
    def build_metadata(self, batch: Any) -> Any:
        """Per-step metadata from an :class:`enginecore.layers.AttentionBatch`, shared by
        every layer of the step."""

    def build_profile_metadata(self, query_lens: list[int]) -> Any:
        """Metadata for the memory-profiling forward: fresh prompts of these lengths
        with no KV cache (``forward`` then gets ``kv_cache=None``)."""
        return list(query_lens)

    @abstractmethod
    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any
    ) -> Any:
        """Write ``key``/``value`` [T, kv_heads, D] into ``kv_cache`` at the step's slots,
        then attend ``query`` [T, heads, D]; returns [T, heads, D]. ``layer`` is the
        :class:`enginecore.layers.Attention` (its scale, window and soft-cap)."""

    def fused_ops(self) -> Any:
        """A :class:`enginecore.layers.FusedOps` with this device's fused kernels for the
        model's norms, rotary embedding and activation, or None."""
        return None

    def fused_decode(self, model: Any, kv_caches: list[Any]) -> Any:
        """Something that runs a whole decode step of ``model`` in fewer calls than its
        layers make (as CUDA graphs do on a GPU), or None (the default: the layers run).
        Asked once the KV cache exists (again after a wake-up). It offers
        ``handles(batch)``: whether it takes this step (an
        :class:`enginecore.layers.AttentionBatch`, after :meth:`order_decodes`), and
        ``run(input_ids, positions, batch)``: the hidden states the model's forward would
        return, K/V written as :meth:`forward` writes them. Where its ``has_head`` is true,
        ``run(..., head="logits")`` returns the model's ``compute_logits`` of them instead
        and ``run(..., head="tokens")`` each row's argmax of those logits (ties and NaN as
        ``torch.argmax``), which the runner takes for plain greedy steps. The CPU
        backend's runs the decode steps of a Llama-family model with block-quantized or
        float32 weights in one call, the LM head included."""
        return None

    def lora_kernels(self) -> LoRAKernels | None:
        """The :class:`LoRAKernels` that compute LoRA deltas on this backend's device, or
        None (the default: the torch reference, ``enginecore.lora.torch_kernels``)."""
        return None


class LoRAKernels(ABC):
    """The LoRA delta of one projection for a whole batch, grouped by adapter (punica's
    shrink and expand).

    Each adapter in use holds a slot of stacked weights: ``a_stack`` ``[slots, R, in]``
    and ``b_stack`` ``[slots, out, R]`` (scale folded into B; a fused projection's
    slices are stacked along R; B may be a strided view, its last dimension contiguous).
    ``mapping`` is the step's
    :class:`enginecore.lora.mapping.LoRABatchMapping`: ``token_slots`` (``[T]`` int64,
    ``-1`` for a token without an adapter), ``sorted_rows`` (the rows with an adapter,
    grouped by slot) and ``segments`` (``(slot, start, end)`` ranges of ``sorted_rows``).
    Both calls run once per projection per step, whatever mix of adapters it holds.
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def shrink(self, x: Any, a_stack: Any, mapping: Any) -> Any:
        """``buf[t] = x[t] @ a_stack[slot(t)]^T`` (``[T, R]``, float32); rows of tokens
        without an adapter are zero."""

    @abstractmethod
    def expand(self, y: Any, buf: Any, b_stack: Any, mapping: Any) -> None:
        """``y[t] += buf[t] @ b_stack[slot(t)]^T`` in place, for tokens with an adapter."""


class LinearMethod(ABC):
    """How a projection's weights are stored and multiplied.

    Built once per model runner as ``cls(config)``; every linear layer of the model keeps
    a reference. ``create_weights`` runs in the layer's constructor (register the
    parameters, each with a ``weight_loader``), ``process_weights_after_loading`` once
    the checkpoint is loaded (repack, quantize, transpose), ``apply`` every forward.
    Registered through ``register_linear_methods``; selected by ``model.linear_method``
    (``"auto"``: the supporting method with the highest ``priority``). Test one with
    :class:`enginecore.testing.LinearMethodContract`.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    #: Devices and activation dtypes the method computes for.
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    #: Block formats (GGUF's type names, ``INT4_B32``) whose tensors the loader hands over
    #: still quantized (``enginecore.layers.quantized.QuantizedTensor``); empty: every
    #: weight arrives in floats. Under ``auto`` a quantized checkpoint is served by the
    #: supporting method that names formats, the highest ``priority`` first.
    gguf_formats: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config

    @classmethod
    def unsupported_reason(cls, device: str, dtype: str) -> str | None:
        if device not in cls.devices:
            return f"runs on {'/'.join(cls.devices)}, not {device}"
        if dtype not in cls.dtypes:
            return f"supports {'/'.join(cls.dtypes)}, not {dtype}"
        return None

    @abstractmethod
    def create_weights(self, layer: Any, input_size: int, output_size: int, dtype: Any) -> None:
        """Register this rank's weight parameters on ``layer`` ([output_size, input_size]
        logically); each parameter's ``weight_loader`` should be ``layer.weight_loader``,
        which copies this rank's shard."""

    def embedding_table(self, layer: Any, blocks: Any) -> Any:
        """The float table of a token embedding (or an LM head) that the loader handed over
        in one of ``gguf_formats``, as an ``enginecore.layers.quantized.QuantizedTensor``:
        a tensor of ``layer.weight``'s shape and dtype that becomes the weight as it is
        (a table kept from an earlier load and mapped from disk, say), or None (the
        default) to have the blocks de-quantized and copied into the weight."""
        return None

    def process_weights_after_loading(self, layer: Any) -> None:
        """Called once per layer after every weight is loaded (and again after a reload).
        Also called for an LM head (a :class:`enginecore.layers.VocabParallelEmbedding`
        whose table computes the logits)."""
        return None

    @abstractmethod
    def apply(self, layer: Any, x: Any, bias: Any = None) -> Any:
        """``x @ W^T (+ bias)`` for ``x`` [T, input_size]."""

    def apply_silu_and_mul(self, layer: Any, x: Any, bias: Any = None) -> Any:
        """For a gated projection (``layer.gated``): ``silu(gate) * up`` of ``apply``'s
        result, in one pass where the method can fuse it; None to let the layer do it."""
        return None
