"""EngineCore: the scheduler + executor loop, independent of how requests arrive.

``EngineCoreProc`` (engine/core_proc.py) wraps it in a process with ZeroMQ I/O threads;
``InprocClient`` uses it directly.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from enginecore import openmp, startup_log
from enginecore.config import DEFAULT_BLOCK_SIZE, EngineConfig
from enginecore.engine.components import Components, resolve_components
from enginecore.engine.inputs_staged import InputsStaged
from enginecore.engine.overlap_choice import OverlapChoice
from enginecore.errors import EngineCoreError, InvalidRequestError, RankError
from enginecore.interfaces import Executor, KVConnectorScheduler, ModelRunner, Scheduler
from enginecore.plugins import PluginHost, make_plugin_manager
from enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
)
from enginecore.registry import import_ref
from enginecore.request import FinishReason, Request, RequestStatus
from enginecore.runner_output import ModelRunnerOutput
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore.startup_errors import build_component, describe_provider
from enginecore.structured_output import StructuredOutputManager
from enginecore.structured_output.manager import GrammarAdvance

logger = logging.getLogger(__name__)
#: Seconds the engine waits for a registered worker RPC's reply beyond its limit: the
#: worker answers with the timeout itself, naming the RPC, before this runs out.
RPC_REPLY_GRACE = 5.0

StepResult = tuple[dict[int, EngineCoreOutputs], bool]


def runner_kv_cache_groups(worker: Any, allow_hybrid: bool) -> list[int | None] | None:
    """Run on each rank: lay its KV cache out in groups (``allow_hybrid``) or as one, and
    return each group's sliding window. None from a runner that does not group layers."""
    runner: ModelRunner = worker.model_runner
    return runner.get_kv_cache_groups(allow_hybrid)


def runner_block_size(worker: Any) -> int:
    """Worker RPC: tokens per KV block of the rank's model runner (its attention backend's
    where ``cache.block_size`` is unset)."""
    runner = worker.model_runner
    return int(getattr(runner, "block_size", None) or DEFAULT_BLOCK_SIZE)


def _has_work_for_workers(scheduler_output: SchedulerOutput) -> bool:
    """An empty batch still matters when it carries ids the workers must drop."""
    return bool(
        scheduler_output.total_num_scheduled_tokens
        or scheduler_output.finished_req_ids
        or scheduler_output.preempted_req_ids
        # KV connector: loads to start and transfers to poll, even in an empty step.
        or scheduler_output.kv_connector_metadata is not None
        # LoRA: adapter reads to start, and finished reads to collect.
        or bool(scheduler_output.lora_loads)
        or bool(scheduler_output.lora_removals)
    )


class EngineCore:
    """Builds executor, KV cache and scheduler in dependency order, then steps them."""

    def __init__(self, config: EngineConfig, plugin_host: PluginHost | None = None) -> None:
        started = time.monotonic()
        # Before plugins or the executor load torch here (an engine in the caller's process).
        openmp.apply_in_process()
        self.config = config
        self.plugins = plugin_host or make_plugin_manager(
            config.plugins.enabled, config.plugins.disabled
        )
        self.components: Components = resolve_components(config, self.plugins)
        if config.cache.block_size is None and self.components.worker_spec.kv_connector_ref:
            # Engines that exchange KV blocks agree on their size: the default, not a choice.
            config.cache.block_size = DEFAULT_BLOCK_SIZE
        # The scheduler half of a KV connector checks its settings before anything starts.
        kv_connector = self._make_kv_connector()
        # Grammars compile off the loop; requests wait there until theirs is ready.
        self.structured_output = StructuredOutputManager(config, self.plugins)
        # 1. executor: workers start and load weights.
        startup_log.logger.info("starting the executor and loading the model %s", config.model.path)
        self.executor: Executor = build_component(
            self.plugins,
            "executor",
            self.components.executor_name,
            self.components.executor_cls,
            config,
            self.components.worker_spec,
        )
        try:
            if config.cache.block_size is None:  # the attention backend's, as the runners chose
                config.cache.block_size = int(
                    self.executor.collective_rpc(runner_block_size, unique_reply_rank=0)
                )
            # 2. profile memory and size the KV cache; 3. the scheduler knows its blocks.
            self.kv_cache_groups = self._kv_cache_groups(kv_connector)
            self.max_model_len, self.num_blocks = self._initialize_kv_cache()
            policy = build_component(
                self.plugins,
                "scheduling_policy",
                config.scheduler.policy,
                self.components.policy_cls,
                config,
            )
            self.scheduler: Scheduler = build_component(
                self.plugins,
                "scheduler",
                config.scheduler.name,
                self.components.scheduler_cls,
                config,
                num_blocks=self.num_blocks,
                max_model_len=self.max_model_len,
                policy=policy,
                kv_connector=kv_connector,
                log_stats=True,
                **({"kv_cache_groups": self.kv_cache_groups} if self.kv_cache_groups else {}),
            )
        except BaseException:
            self.executor.shutdown()
            if kv_connector is not None:
                kv_connector.shutdown()
            raise
        async_ok = config.scheduler.async_scheduling and self.scheduler.supports_async_scheduling
        self.batch_queue_size = self.executor.max_concurrent_batches if async_ok else 1
        self.batch_queue: deque[tuple[Future[Any], Future[Any], SchedulerOutput]] = deque()
        #: Whether each async step overlaps the next batch or runs the synchronous way.
        self.overlap_choice = OverlapChoice(
            self.batch_queue_size > 1 and config.scheduler.async_scheduling_adaptive
        )
        self._seq_no = 0
        self._paused: str | None = None  # None, or the pause mode
        self._sleeping = False
        self.held_outputs: list[dict[int, EngineCoreOutputs]] = []
        self.startup_seconds = time.monotonic() - started
        startup_log.logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens, max_model_len %d, %s",
            self.startup_seconds,
            self.num_blocks,
            config.cache.tokens_per_block,
            self.max_model_len,
            ", ".join(f"{k}={v}" for k, v in self.components.providers.items()),
        )
        self.plugins.engine_started(config, self.ready_info())

    # --- start-up -------------------------------------------------------------------------

    def _make_kv_connector(self) -> KVConnectorScheduler | None:
        """The scheduler-side half of the configured KV connector (workers build theirs)."""
        ref = self.components.worker_spec.kv_connector_ref
        if ref is None:
            return None
        name = self.config.kv_transfer.connector or ""
        connector: KVConnectorScheduler = build_component(
            self.plugins,
            "kv_connector",
            name,
            lambda: import_ref(ref)().scheduler_side(self.config),
        )
        return connector

    def _kv_cache_groups(self, kv_connector: Any) -> list[int | None] | None:
        """The sliding window of each KV cache group, as the model runners lay the cache
        out (None: one group, every position kept). Sliding layers keep only their window
        where the scheduler manages groups and no KV connector moves blocks (a connector
        sees one block table); otherwise the runners keep one group, the window a mask."""
        allow = kv_connector is None and getattr(
            self.components.scheduler_cls, "supports_kv_cache_groups", False
        )
        groups = self.executor.collective_rpc(
            runner_kv_cache_groups, args=(allow,), unique_reply_rank=0
        )
        if not groups or groups == [None]:
            return None
        if not all(w is None or (isinstance(w, int) and w > 0) for w in groups):
            raise EngineCoreError(
                f"model runner {self.components.worker_spec.model_runner_ref}: "
                f"get_kv_cache_groups returned {groups!r}; expected a list with each group's "
                "sliding window (a positive int) or None for full attention"
            )
        return list(groups)

    def _longest_request_tokens(self, usable_blocks: int, max_model_len: int) -> int:
        """The longest request the cache holds alone. A sliding group holds at most its
        window and one step's tokens; a full-attention group every position."""
        bs = self.config.cache.tokens_per_block
        groups = self.kv_cache_groups or [None]
        sched = self.config.scheduler
        step_tokens = sched.max_num_batched_tokens or (
            2048 if sched.chunked_prefill else max_model_len
        )
        step_tokens = max(step_tokens, sched.max_num_seqs) + (
            self.config.speculative.num_speculative_tokens if self.config.speculative.enabled else 0
        )
        sliding = sum(
            min(-(-max_model_len // bs), -(-(w + step_tokens) // bs) + 1)
            for w in groups
            if w is not None
        )
        num_full = sum(1 for w in groups if w is None)
        left = max(usable_blocks - sliding, 0)
        if not num_full:
            return max_model_len if left else 0
        return left // num_full * bs

    def _blocks_for(self, max_model_len: int) -> int:
        """KV blocks one request of ``max_model_len`` tokens needs (the inverse of
        :meth:`_longest_request_tokens`), the null block included."""
        blocks = 1
        while self._longest_request_tokens(blocks - 1, max_model_len) < max_model_len:
            blocks *= 2
        low = blocks // 2
        while low + 1 < blocks:  # the smallest count that holds it
            middle = (low + blocks) // 2
            if self._longest_request_tokens(middle - 1, max_model_len) >= max_model_len:
                blocks = middle
            else:
                low = middle
        return blocks

    def _initialize_kv_cache(self) -> tuple[int, int]:
        cache = self.config.cache
        max_model_len = self.executor.get_max_model_len()
        if cache.num_blocks_override is not None:
            num_blocks = cache.num_blocks_override
        else:
            startup_log.logger.info("sizing the KV cache")
            available = min(self.executor.determine_available_memory())
            block_bytes = self.executor.get_kv_cache_block_bytes()
            num_blocks = available // block_bytes
            if num_blocks < 2:
                raise EngineCoreError(
                    f"not enough memory for the KV cache: {available} bytes available, one "
                    f"block takes {block_bytes}. Give it more with --kv-cache-bytes, "
                    f"--cpu-kv-cache-fraction or --gpu-memory-utilization."
                )
        capacity = self._longest_request_tokens(num_blocks - 1, max_model_len)
        if capacity <= 0:
            raise EngineCoreError(
                f"a KV cache of {num_blocks} blocks cannot hold one step of a request: the "
                f"sliding windows {self.kv_cache_groups} need more. Give the cache more "
                "memory, or lower max_num_batched_tokens."
            )
        if (
            capacity < max_model_len
            and self.config.model.max_model_len is not None
            and cache.num_blocks_override is None
        ):
            # vLLM's rule: a context length the operator asked for is served in full or
            # the engine does not start (unset, it is fitted to the cache below).
            block_bytes = self.executor.get_kv_cache_block_bytes()
            needed = self._blocks_for(max_model_len) * block_bytes
            raise EngineCoreError(
                f"max_model_len {max_model_len} needs a KV cache of {_size(needed)} "
                f"({self._blocks_for(max_model_len)} blocks of {block_bytes} bytes) to serve "
                f"one request of that length, more than the {_size(num_blocks * block_bytes)} "
                f"available for it; that memory holds max_model_len {capacity}. Give the "
                "cache more memory (--gpu-memory-utilization, --kv-cache-bytes, "
                "--cpu-kv-cache-fraction), lower --max-model-len, or leave it unset to fit "
                "the cache."
            )
        if capacity < max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len %d: "
                "max_model_len is lowered to %d",
                capacity,
                max_model_len,
                capacity,
            )
            max_model_len = capacity
        startup_log.logger.info(
            "allocating the KV cache: %d blocks of %d tokens", num_blocks, cache.tokens_per_block
        )
        self.executor.initialize_cache(num_blocks)
        return max_model_len, num_blocks

    def ready_info(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "num_blocks": self.num_blocks,
            "block_size": self.config.cache.tokens_per_block,
            "components": dict(self.components.providers),
            "startup_seconds": self.startup_seconds,
        }

    def ready_response(self) -> EngineCoreReadyResponse:
        import os

        return EngineCoreReadyResponse(
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.config.cache.tokens_per_block,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            components=dict(self.components.providers),
            pid=os.getpid(),
        )

    # --- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request.request_id).__name__}")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError(f"request {request.request_id!r}: the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"request {request.request_id!r}: prompt of {num_prompt} tokens leaves no room "
                f"to generate within max_model_len {self.max_model_len}"
            )
        max_tokens = request.max_tokens or request.sampling_params.max_tokens
        room = self.max_model_len - num_prompt
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        self._seq_no += 1
        core_request = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            seq_no=self._seq_no,
            priority=request.priority,
            cache_salt=request.cache_salt,
            client_index=request.client_index,
            max_tokens=max_tokens,
            lora_request=request.lora_request,
        )
        if request.sampling_params.structured_output is not None:
            self.structured_output.add_request(core_request)  # the scheduler gets it when compiled
        else:
            self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.structured_output.abort(request_ids, RequestStatus.FINISHED_ABORTED)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort_all_requests(self) -> list[str]:
        """Abort every request, including those waiting for a grammar; returns their ids."""
        waiting = self.structured_output.waiting_ids()
        self.structured_output.abort(waiting, RequestStatus.FINISHED_ABORTED)
        aborted = self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.structured_output.abort(
            [r.request_id for r in aborted], RequestStatus.FINISHED_ABORTED
        )
        return waiting + [r.request_id for r in aborted]

    def has_work(self) -> bool:
        return bool(self.batch_queue) or (
            self._paused != "keep"
            and (self.scheduler.has_requests() or self.structured_output.has_waiting())
        )

    # --- the step -------------------------------------------------------------------------

    def _apply_pending_aborts(self) -> None:
        """Aborts that arrived during the forward pass (the process loop overrides this)."""

    def _grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The batch's grammar bitmask, built while the forward pass runs."""
        return self.structured_output.grammar_output(scheduler_output)

    def _admit_compiled(self) -> dict[int, EngineCoreOutputs]:
        """Hand requests whose grammar is ready to the scheduler; fail those that did not compile."""
        if not self.structured_output.has_waiting():
            return {}
        ready, failed = self.structured_output.take_ready()
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except Exception as exc:
                self.structured_output.abort([request.request_id], RequestStatus.FINISHED_ERROR)
                failed.append((request, f"{type(exc).__name__}: {exc}"))
        outputs: dict[int, EngineCoreOutputs] = {}
        for request, message in failed:
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    error=message,
                )
            )
        return outputs

    def _grammar_needs_batch_in_flight(self, scheduler_output: SchedulerOutput) -> bool:
        """A structured request of this batch still waits for a token of a batch in flight:
        its bitmask can only be built once that token is known (async scheduling)."""
        ids = scheduler_output.structured_output_request_ids
        if not ids or not self.batch_queue:
            return False
        in_flight = set()
        for _, _, earlier in self.batch_queue:
            in_flight.update(earlier.structured_output_request_ids)
        return not in_flight.isdisjoint(ids)

    def _launch(self, scheduler_output: SchedulerOutput) -> tuple[Future[Any], Future[Any]]:
        if not scheduler_output.structured_output_request_ids:
            return self.executor._launch_step(scheduler_output, None)
        # The grammars' bitmask is built while the forward runs.
        execute = self.executor.execute_model(scheduler_output, non_block=True)
        grammar = self._grammar_output(scheduler_output)
        sample = self.executor.sample_tokens(grammar, non_block=True)
        return execute, sample

    @staticmethod
    def _result(execute: Future[Any], sample: Future[Any]) -> ModelRunnerOutput:
        """The step's output; ``execute is sample`` where the executor ran both halves
        as one call (:meth:`Executor._launch_step`), whose result is the output."""
        if execute is sample:
            output: ModelRunnerOutput = sample.result()
            return output
        executed: ModelRunnerOutput | None = execute.result()
        sampled: ModelRunnerOutput = sample.result()
        return executed if executed is not None else sampled

    def _update(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        grammar_advance: GrammarAdvance | None = None,
    ) -> dict[int, EngineCoreOutputs]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.request_errors:
            self._fail_requests(outputs, runner_output.request_errors)
        if scheduler_output.structured_output_request_ids:
            if grammar_advance is None:  # not advanced ahead of the update
                grammar_advance = self.structured_output.accept_sampled(
                    scheduler_output, runner_output
                )
            self._settle_grammars(outputs, grammar_advance)
        if (
            not outputs
            and not scheduler_output.total_num_scheduled_tokens
            and scheduler_output.kv_connector_metadata is not None
        ):
            # A step that only polled KV transfers (every 1 ms while requests wait for
            # them): its stats ride with the next step that has outputs.
            return outputs
        stats = self.scheduler.make_stats()
        if stats is not None:
            # One stats record per step, on client 0's outputs (created if it had none).
            outputs.setdefault(0, EngineCoreOutputs()).scheduler_stats = stats
        return outputs

    def _fail_requests(self, outputs: dict[int, EngineCoreOutputs], errors: dict[str, str]) -> None:
        """Finish with its error each request the runner could not go on with (its
        tokens of this step are kept); one that finished anyway this step stays as is."""
        for client_outputs in outputs.values():
            client_outputs.unfold_plain(errors)  # amended below, as objects
        failing = {
            output.request_id: output
            for client_outputs in outputs.values()
            for output in client_outputs.outputs
            if output.request_id in errors and output.finish_reason is None
        }
        if not failing:
            return
        for request_id, output in failing.items():
            logger.error("request %s failed: %s", request_id, errors[request_id])
            output.finish_reason = FinishReason.ERROR
            output.error = errors[request_id]
        self.scheduler.finish_requests(list(failing), RequestStatus.FINISHED_ERROR)

    def _settle_grammars(
        self, outputs: dict[int, EngineCoreOutputs], advance: GrammarAdvance
    ) -> None:
        """Finish with ``stop`` requests whose grammar ended; drop finished requests'
        grammars; fail requests whose grammar rejected a token."""
        if advance.ended:
            self._finish_ended_grammars(outputs, advance.ended)
        self.structured_output.release_finished(outputs)
        if not advance.rejected:
            return
        errors = dict(advance.rejected)
        self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                if output.request_id in errors:
                    output.finish_reason = FinishReason.ERROR
                    output.error = errors[output.request_id]

    def _finish_ended_grammars(
        self, outputs: dict[int, EngineCoreOutputs], ended: dict[str, int]
    ) -> None:
        """The structured output is complete once its grammar is (``ignore_eos`` samples
        on past the grammar's stop token): finish the request as a stop token would, and
        drop what this step sampled after the end. A step still in flight for it is
        dropped by the scheduler, which no longer knows the request."""
        stopped: list[str] = []
        for client_outputs in outputs.values():
            client_outputs.unfold_plain(ended)  # amended below, as objects
            for output in client_outputs.outputs:
                kept = ended.get(output.request_id)
                if kept is None or output.finish_reason not in (None, FinishReason.LENGTH):
                    continue  # not ended here, or finished otherwise (a stop token, an error)
                if output.finish_reason is None:
                    stopped.append(output.request_id)
                output.finish_reason = FinishReason.STOP
                if len(output.new_token_ids) > kept:
                    _truncate_output(output, kept)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

    def step(self) -> StepResult:
        """Schedule, execute, sample and update, one batch at a time (the simplest loop)."""
        failed = self._admit_compiled()
        if self._paused == "keep" or not self.scheduler.has_requests():
            return failed, False
        scheduler_output = self.scheduler.schedule()
        if not _has_work_for_workers(scheduler_output):
            return failed, False
        execute, sample = self._launch(scheduler_output)
        runner_output = self._result(execute, sample)
        self._apply_pending_aborts()
        outputs = self._update(scheduler_output, runner_output)
        self.overlap_choice.completed(len(scheduler_output.num_scheduled_tokens), False)
        return _merge(outputs, failed), scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> StepResult:
        """Schedule batch N+1 while batch N computes (async scheduling).

        The scheduler plans with placeholders for tokens not yet sampled; the worker fills
        them in from its own sampled tokens. Results are consumed oldest first.
        """
        queue = self.batch_queue
        choice = self.overlap_choice
        overlap = choice.overlap()
        if not overlap and not queue:
            # Nothing in flight and overlapping measured slower: this batch the
            # synchronous way (the scheduler plans it as the synchronous loop would).
            return self.step()
        scheduled = False
        failed = self._admit_compiled()
        deferred: tuple[Future[Any], SchedulerOutput] | None = None
        if (
            overlap  # else the batch in flight first, then the synchronous way
            and self._paused != "keep"
            and len(queue) < self.batch_queue_size
            and self.scheduler.has_requests()
        ):
            scheduler_output = self.scheduler.schedule()
            if _has_work_for_workers(scheduler_output):
                scheduled = scheduler_output.total_num_scheduled_tokens > 0
                if self._grammar_needs_batch_in_flight(scheduler_output):
                    # Run the forward pass now; sample once the earlier batch's tokens
                    # have advanced the grammars (below).
                    execute = self.executor.execute_model(scheduler_output, non_block=True)
                    deferred = (execute, scheduler_output)
                else:
                    execute, sample = self._launch(scheduler_output)
                    queue.appendleft((execute, sample, scheduler_output))
                    if len(queue) < self.batch_queue_size and not queue[-1][1].done():
                        return failed, scheduled  # room for one more batch: plan it first
                if len(queue) > 1 or deferred is not None:
                    self._await_inputs_staged()
        if not queue:
            return failed, False
        execute, sample, scheduler_output = queue.pop()
        runner_output = self._result(execute, sample)
        advance = None
        if deferred is not None:
            # The deferred batch's bitmask needs only these tokens in the grammars: advance
            # them and let it sample before the scheduler's update, which then overlaps.
            advance = self.structured_output.accept_sampled(scheduler_output, runner_output)
            next_execute, next_output = deferred
            grammar = self._grammar_output(next_output)
            next_sample = self.executor.sample_tokens(grammar, non_block=True)
            queue.appendleft((next_execute, next_sample, next_output))
        self._apply_pending_aborts()
        outputs = self._update(scheduler_output, runner_output, advance)
        choice.completed(len(scheduler_output.num_scheduled_tokens), overlap)
        return _merge(outputs, failed), scheduled

    def _await_inputs_staged(self) -> None:
        """Before the engine's own work for the oldest batch, let a worker in this process
        stage the inputs of the batch just launched: the two would otherwise take turns
        with the interpreter lock and delay its forward (:mod:`.inputs_staged`). An
        executor whose workers run elsewhere has no signal, and nothing is waited for."""
        staged: InputsStaged | None = getattr(self.executor, "inputs_staged", None)
        if staged is not None:
            staged.wait()

    def send_plain_steps_as_columns(self) -> None:
        """Ask the scheduler for plain steps as columns of the outputs
        (``EngineCoreOutputs.plain_req_ids``) where it can make them: for a frontend that
        reads them (``OutputProcessor.process_plain``). Unasked, every output is an
        ``EngineCoreOutput``, as a caller of :meth:`step` reading ``outputs`` expects."""
        self.scheduler.plain_output_columns = True

    def step_fn(self) -> Callable[[], StepResult]:
        return self.step_with_batch_queue if self.batch_queue_size > 1 else self.step

    # --- utility calls (between steps) -----------------------------------------------------

    def utilities(self) -> dict[str, Callable[..., Any]]:
        """The calls a client may make by name (``call_utility``), and nothing else: the
        engine never looks an arbitrary name up on itself."""
        return {
            "ping": self.ping,
            "get_supported_tasks": self.get_supported_tasks,
            "is_sleeping": self.is_sleeping,
            "sleep": self.sleep,
            "wake_up": self.wake_up,
            "get_num_unfinished_requests": self.get_num_unfinished_requests,
            "reset_prefix_cache": self.reset_prefix_cache,
            "collective_rpc": self.collective_rpc,
        }

    def ping(self) -> str:
        if self.config.kv_transfer.connector:
            # The workers' connector threads (a KV block server) count as the engine.
            self.executor.check_health()
        return "pong"

    def get_supported_tasks(self) -> list[str]:
        return ["generate"]

    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self, level: int = 1) -> None:
        """Free device memory between batches (vLLM's sleep mode): finish the batches in
        flight, hold queued requests, drop the prefix cache (its blocks' contents go),
        then the workers free the KV cache (level 1) and the weights too (level 2)."""
        self._paused = "keep"
        self.emit_drained(self.drain_batch_queue())
        if level >= 1:
            self.scheduler.reset_prefix_cache()
        self.executor.sleep(level)
        self._sleeping = True

    def wake_up(self) -> None:
        self.executor.wake_up()
        self._sleeping = False
        self._paused = None

    def emit_drained(self, drained: list[dict[int, EngineCoreOutputs]]) -> None:
        """Outputs of batches finished off the step (before sleeping): kept for the next
        ``get_output`` of a client in this process; the engine process sends them."""
        self.held_outputs.extend(drained)

    def admission_refusal(self) -> str | None:
        """Why a new request is refused now (paused or asleep), or None."""
        if self._paused is None:  # "keep" too refuses: a new request would only wait
            return None
        state = "asleep" if self._sleeping else "paused"
        return f"engine_paused: the engine is {state}; retry after it resumes"

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests() + self.structured_output.num_waiting

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if isinstance(method, str) and method in self.plugins.registry("worker_rpc"):
            # Plugin code: each worker runs it where it can be abandoned (rpc_watchdog).
            limit = timeout if timeout is not None else self.config.engine.rpc_timeout
            call_args = (method, limit, tuple(args), kwargs or {})
            try:
                registered: list[Any] = self.executor.collective_rpc(
                    "call_registered_rpc", args=call_args, timeout=limit + RPC_REPLY_GRACE
                )
            except RankError as exc:  # named as the RPC's, with its plugin
                if exc.method != "call_registered_rpc":
                    raise
                provider, _ = describe_provider(self.plugins, "worker_rpc", method)
                raise RankError(exc.rank, method, f"{exc.detail} ({provider})") from exc
            return registered
        results: list[Any] = self.executor.collective_rpc(
            method, args=args, kwargs=kwargs, timeout=timeout
        )
        return results

    def drain_batch_queue(self) -> list[dict[int, EngineCoreOutputs]]:
        """Finish every in-flight batch (before sleeping, pausing or shutting down)."""
        results = []
        while self.batch_queue:
            execute, sample, scheduler_output = self.batch_queue.pop()
            runner_output = self._result(execute, sample)
            results.append(self._update(scheduler_output, runner_output))
        return results

    def shutdown(self) -> None:
        try:
            self.drain_batch_queue()
        except Exception:
            logger.exception("error while draining in-flight batches at shutdown")
        self.structured_output.shutdown()
        self.scheduler.shutdown()
        self.executor.shutdown()
        self.plugins.engine_stopped("shutdown")


def _merge(
    outputs: dict[int, EngineCoreOutputs], more: dict[int, EngineCoreOutputs]
) -> dict[int, EngineCoreOutputs]:
    for client, extra in more.items():
        if client in outputs:
            outputs[client].extend(extra)
        else:
            outputs[client] = extra
    return outputs


def _size(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that keeps a whole number before the point."""
    value = float(num_bytes)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} bytes" if unit == "bytes" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _truncate_output(output: EngineCoreOutput, kept: int) -> None:
    """Keep only an output's first ``kept`` new tokens (and their logprobs)."""
    output.new_token_ids = output.new_token_ids[:kept]
    if output.new_logprob_token_ids is not None:
        output.new_logprob_token_ids = output.new_logprob_token_ids[:kept]
    if output.new_logprobs is not None:
        output.new_logprobs = output.new_logprobs[:kept]
    if output.new_sampled_ranks is not None:
        output.new_sampled_ranks = output.new_sampled_ranks[:kept]
