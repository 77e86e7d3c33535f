"""``AsyncLLM``: the asyncio frontend the HTTP server runs on.

One background task reads each step's ``EngineCoreOutputs`` from the engine process,
folds it into per-request state (detokenizing, stop strings) in chunks so that a large
batch never holds the event loop for long, and drops each request's new output into that
request's :class:`~enginecore.engine.collector.RequestOutputCollector`. Callers iterate
``generate(...)``; leaving the iteration early (``break``, task cancellation, a client
that disconnected) aborts the request in the engine.

The same task builds the frontend's per-step statistics and feeds the selected stat
loggers and the ``request_finished`` plugin hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from enginecore.component_check import check_components
from enginecore.config import EngineConfig, make_config
from enginecore.engine.chat_template import Message, render_chat
from enginecore.engine.client import start_engine
from enginecore.engine.collector import RequestOutputCollector
from enginecore.engine.dp_coordinator import check_data_parallel_rank
from enginecore.engine.input_processor import InputProcessor, PromptType
from enginecore.engine.model_defaults import configured_chat_template
from enginecore.engine.output import (
    CompletionOutput,
    OutputKind,
    OutputProcessor,
    RequestOutput,
    RequestState,
)
from enginecore.errors import (
    KV_TRANSFER_ERROR_PREFIX,
    EngineCoreError,
    EngineDeadError,
    EngineShutdownError,
    InvalidRequestError,
)
from enginecore.hub import resolve_model
from enginecore.interfaces import IterationStats
from enginecore.lora_request import LoRARequest
from enginecore.metrics.iteration import IterationStatsBuilder, finished_request_stats
from enginecore.metrics.manager import StatLoggerManager
from enginecore.params import SamplingParams
from enginecore.plugins import PluginHost, make_plugin_manager
from enginecore.protocol import EngineCoreOutputs, SchedulerStats
from enginecore.request import FinishReason

logger = logging.getLogger(__name__)

#: Request outputs folded per slice of the event loop (then the loop gets a turn).
OUTPUT_CHUNK_SIZE = 128
#: Seconds ``check_health`` waits for the engine core to answer a ping.
HEALTH_TIMEOUT = 10.0


class RequestRejectedError(EngineCoreError):
    """The engine core refused a request (paused, shutting down, invalid for the engine)."""

    @property
    def retryable(self) -> bool:
        text = str(self)
        return text.startswith("engine_paused") or "shutting down" in text

    @property
    def kv_transfer_failed(self) -> bool:
        """The request's KV cache could not be loaded from another instance (a prefill
        instance that died or did not answer): a failure upstream, not the client's."""
        return str(self).startswith(KV_TRANSFER_ERROR_PREFIX)


class AsyncLLM:
    """Serve requests from asyncio: ``async for out in llm.generate(prompt, params, "id")``.

    Constructed like :class:`~enginecore.LLM` (``AsyncLLM(model="path", max_num_seqs=64)``
    or ``AsyncLLM(config=EngineConfig(...))``). ``output_kind`` (default DELTA: each output
    holds only what is new) may be changed per instance or per call.
    """

    def __init__(
        self,
        model: str | pathlib.Path | None = None,
        *,
        config: EngineConfig | None = None,
        config_file: str | pathlib.Path | None = None,
        plugin_host: PluginHost | None = None,
        **overrides: Any,
    ) -> None:
        if model is not None:
            overrides["model"] = str(model)
        self.config = resolve_model(make_config(config_file, base=config, **overrides))
        self.output_kind = OutputKind.DELTA
        self.plugins = plugin_host or make_plugin_manager(
            self.config.plugins.enabled, self.config.plugins.disabled
        )
        check_components(self.config, self.plugins)  # every bad name at once, before any process
        self.chat_template = configured_chat_template(self.config)
        # Built before the engine so that an unknown logger name fails in seconds.
        self.stat_loggers = StatLoggerManager(self.config, self.plugins)
        self.engine_client: Any
        self.engine_client, self.tokenizer = start_engine(
            self.config, asyncio_mode=True, plugins=self.plugins
        )
        self.ready = self.engine_client.ready
        self.max_model_len = self.ready.max_model_len
        self.input_processor = InputProcessor(
            self.config, self.tokenizer, self.max_model_len, self.plugins
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.collectors: dict[str, RequestOutputCollector] = {}
        self._request_counter = itertools.count()
        self._output_task: asyncio.Task[Any] | None = None
        self._log_task: asyncio.Task[Any] | None = None
        self._dead: EngineCoreError | None = None
        self._closed = False
        # "paused" or "asleep" while new requests would only wait: they are refused.
        self._unavailable: str | None = None
        self.stat_loggers.log_engine_initialized(self.ready)

    # --- properties ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name or self.config.model.path

    @property
    def components(self) -> dict[str, str]:
        """What the engine resolved at start-up: kind -> "name (from plugin)"."""
        return dict(self.ready.components)

    @property
    def errored(self) -> bool:
        return self._dead is not None or self.engine_client.dead_error is not None

    @property
    def dead_error(self) -> EngineCoreError | None:
        return self._dead or self.engine_client.dead_error

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # --- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        output_kind: OutputKind | None = None,
        arrival_time: float | None = None,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate and submit a request; returns its collector. Raises at once on bad input.

        ``data_parallel_rank`` sends it to that replica (external load balancing) instead
        of the least-loaded one. Must be called from the event loop that consumes the
        outputs.
        """
        self._check_alive()
        if self._unavailable is not None:
            raise RequestRejectedError(
                f"engine_paused: the engine is {self._unavailable}; retry after it resumes"
            )
        self._ensure_tasks()
        par = self.config.parallel
        check_data_parallel_rank(
            par.data_parallel_size, par.data_parallel_external_lb, data_parallel_rank
        )
        params = sampling_params or SamplingParams()
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        kind = output_kind or self.output_kind
        request, text = self.input_processor.process(
            request_id,
            prompt,
            params,
            priority=priority,
            arrival_time=arrival_time,
            lora_request=lora_request,
        )
        request.data_parallel_rank = data_parallel_rank
        collector = RequestOutputCollector(request_id, kind)
        engine_requests = self.output_processor.add_engine_request(
            request, text, output_kind=kind, queue=collector
        )
        self.collectors[request_id] = collector
        try:
            for engine_request in engine_requests:
                self.engine_client.add_request(engine_request)
        except BaseException:
            # e.g. the named replica is dead: nothing of this request stays behind.
            self.collectors.pop(request_id, None)
            with contextlib.suppress(EngineCoreError):
                self.engine_client.abort_requests(
                    self.output_processor.abort_requests([request_id])
                )
            raise
        return collector

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        output_kind: OutputKind | None = None,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (DELTA: new text and tokens only);
        ``lora_request`` serves it with a LoRA adapter (``enable_lora``)."""
        collector = self.add_request(
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            output_kind=output_kind,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
        )
        async for output in self.stream(collector):
            yield output

    async def stream(self, collector: RequestOutputCollector) -> AsyncIterator[RequestOutput]:
        """Iterate a submitted request's collector; leaving early aborts the request."""
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        except BaseException:
            finished = finished or collector.finished
            raise
        finally:
            if not finished:
                self.abort(collector.request_id)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (user-facing ids) in the frontend and the engine; idempotent."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        now = time.monotonic()
        aborted_states = self._states_of(ids)
        engine_ids = self.output_processor.abort_requests(ids)
        if engine_ids and self._dead is None:
            with contextlib.suppress(EngineCoreError):
                self.engine_client.abort_requests(engine_ids)
        for request_id in ids:
            collector = self.collectors.pop(request_id, None)
            if collector is not None and not collector.finished:
                collector.put(_aborted_output(request_id, aborted_states, collector.output_kind))
        if aborted_states:
            stats = IterationStats(timestamp=now)
            stats.finished_requests = [
                finished_request_stats(s, now, FinishReason.ABORT) for s in aborted_states
            ]
            self._record(None, stats)

    def _states_of(self, ids: list[str]) -> list[RequestState]:
        return self.output_processor.states_of(ids)

    # --- the output task ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineShutdownError("this AsyncLLM has been shut down")
        error = self.dead_error
        if error is not None:
            raise error

    def _ensure_tasks(self) -> None:
        if self._output_task is None:
            loop = asyncio.get_running_loop()
            self._output_task = loop.create_task(self._run_output_loop(), name="enginecore-out")
            interval = self.config.observability.log_stats_interval
            if self.stat_loggers.loggers and interval > 0:
                self._log_task = loop.create_task(self._run_log_loop(interval))

    async def _run_output_loop(self) -> None:
        try:
            while True:
                outputs = await self.engine_client.get_output_async()
                await self._process_engine_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            logger.error("%s", exc)
            self._fail_all(exc)
        except Exception as exc:  # a bug in output processing: fail loudly, not silently
            logger.exception("the AsyncLLM output task failed")
            self._fail_all(
                EngineDeadError(f"the frontend output task failed: {type(exc).__name__}: {exc}")
            )

    def _deliver(
        self,
        ready: list[tuple[Any, RequestOutput]],
        to_abort: list[str],
        errors: dict[str, str] | None = None,
    ) -> None:
        """Hand each ready output to its request's collector (its error instead, where the
        engine reported one); abort what the frontend stopped."""
        failed: list[str] = []
        for state, request_output in ready:
            collector: RequestOutputCollector | None = state.queue
            if collector is None:
                continue
            error = errors.get(state.request_id) if errors else None
            if error is not None:
                collector.put(RequestRejectedError(error))
                failed.append(collector.request_id)
                continue
            collector.put(request_output)
            if request_output.finished:
                self.collectors.pop(collector.request_id, None)
        if to_abort:
            self.engine_client.abort_requests(to_abort)
        if failed:
            self.abort(failed)  # drops the sibling samples of an n > 1 request

    async def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_dead is not None:
            self._fail_replica_requests(outputs)
            return
        now = time.monotonic()
        op = self.output_processor
        builder = IterationStatsBuilder(now)
        items = outputs.outputs
        for start in range(0, len(items), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)  # a big batch yields the loop between chunks
            chunk = items[start : start + OUTPUT_CHUNK_SIZE]
            errors = {out.request_id: out.error for out in chunk if out.error}
            self._deliver(*op.process_outputs(chunk, now, builder), errors)
        plain_ids, plain_tokens = outputs.plain_req_ids, outputs.plain_token_ids
        for start in range(0, len(plain_ids), OUTPUT_CHUNK_SIZE):
            if start or items:
                await asyncio.sleep(0)
            end = start + OUTPUT_CHUNK_SIZE
            self._deliver(
                *op.process_plain(plain_ids[start:end], plain_tokens[start:end], now, builder)
            )
        self._record(outputs.scheduler_stats, builder.stats, outputs.engine_index)

    def _record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
        engine_index: int = 0,
    ) -> None:
        self.stat_loggers.record(scheduler_stats, iteration_stats, engine_index)
        for finished in iteration_stats.finished_requests:
            self.plugins.request_finished(finished)

    async def _run_log_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.stat_loggers.log()

    def _fail_replica_requests(self, outputs: EngineCoreOutputs) -> None:
        """One data-parallel replica died: only the requests it served fail."""
        error = EngineDeadError(outputs.engine_dead)
        lost = outputs.finished_requests or set()
        user_ids = set()
        for request_id in lost:
            state = self.output_processor.states.get(request_id)
            if state is not None:
                user_ids.add(state.parent.request_id if state.parent else state.request_id)
        for user_id in user_ids:
            collector = self.collectors.pop(user_id, None)
            # Siblings of an n > 1 request on live replicas are aborted there.
            self.engine_client.abort_requests(self.output_processor.abort_requests([user_id]))
            if collector is not None:
                collector.put(error)

    def start(self) -> None:
        """Start the output task now rather than at the first request: a server calls it
        so that an engine that dies is noticed without traffic."""
        self._ensure_tasks()

    def fail_all_open(self, error: EngineCoreError) -> None:
        """Abort every open request in the engine and end each one with ``error`` (a
        draining server's last word to the requests it gives up on)."""
        ids = list(self.collectors)
        engine_ids = self.output_processor.abort_requests(ids)
        if engine_ids and self.dead_error is None:
            with contextlib.suppress(EngineCoreError):
                self.engine_client.abort_requests(engine_ids)
        for collector in self.collectors.values():
            collector.put(error)
        self.collectors.clear()

    def _fail_all(self, error: EngineCoreError) -> None:
        """Raise ``error`` into every open request at once."""
        self._dead = error
        for collector in self.collectors.values():
            collector.put(error)
        self.collectors.clear()
        self.output_processor.states.clear()
        self.output_processor.parents.clear()

    # --- utilities (run by the engine core between steps) ------------------------------------

    async def _utility(self, method: str, *args: Any) -> Any:
        self._check_alive()
        self._ensure_tasks()
        return await self.engine_client.call_utility_async(method, *args)

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine core is dead or does not answer.

        With data parallelism, one dead replica already makes the engine unhealthy (so an
        orchestrator replaces it), although the live replicas keep serving meanwhile.
        """
        coordinator = getattr(self.engine_client, "coordinator", None)
        if coordinator is not None and coordinator.dead:
            index, reason = next(iter(coordinator.dead.items()))
            raise EngineDeadError(
                f"data-parallel replica {index} of {coordinator.size} is dead ({reason}); "
                f"the other replicas still serve"
            )
        wire_problem = getattr(self.engine_client, "wire_problem", None)
        if wire_problem is not None and (problem := wire_problem()) is not None:
            raise EngineDeadError(problem)
        try:
            await asyncio.wait_for(self._utility("ping"), HEALTH_TIMEOUT)
        except TimeoutError:
            raise EngineDeadError(
                f"the engine core did not answer a health check within {HEALTH_TIMEOUT:.0f} s"
            ) from None

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        results: list[Any] = await self._utility(
            "collective_rpc", method, timeout, tuple(args), kwargs
        )
        return results

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read a LoRA adapter into the engine now, before any request names it (vLLM's
        ``add_lora``): returns once every worker holds it read; raises with the reason
        when it cannot be read. Requests keep running meanwhile."""
        added = await self._utility(
            "add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path
        )
        return bool(added)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter from every worker (vLLM's ``remove_lora``): requests
        already sent with it finish first; returns once the workers have freed its device
        slot and host copy (False: the scheduler does not track adapters)."""
        removed = await self._utility("remove_lora", lora_int_id)
        return bool(removed)

    async def reset_prefix_cache(self) -> bool:
        reset: bool = await self._utility("reset_prefix_cache")
        return reset

    async def sleep(self, level: int = 1) -> None:
        """Pause scheduling and release device memory (level 1: KV cache; 2: weights too)."""
        await self._utility("sleep", level)
        self._unavailable = "asleep"
        self.stat_loggers.record_sleep_state(True, level)

    async def wake_up(self) -> None:
        await self._utility("wake_up")
        self._unavailable = None
        self.stat_loggers.record_sleep_state(False)

    async def is_sleeping(self) -> bool:
        return bool(await self._utility("is_sleeping"))

    async def pause(self, mode: str = "abort") -> None:
        """Stop scheduling: ``abort`` in-flight requests, ``wait`` for them, or ``keep`` them."""
        await self._utility("pause_scheduler", mode)
        self._unavailable = "paused"

    async def resume(self) -> None:
        await self._utility("resume_scheduler")
        self._unavailable = None

    async def is_paused(self) -> bool:
        return bool(await self._utility("is_paused"))

    async def get_num_unfinished_requests(self) -> int:
        """Requests the engine core's scheduler still holds (0 once all are done)."""
        return int(await self._utility("get_num_unfinished_requests"))

    # --- prompts ---------------------------------------------------------------------------------

    def chat_prompt(
        self,
        messages: list[Message],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template (``LLM.chat``'s path);
        ``continue_final_message`` leaves the last message open for the reply to continue."""
        return render_chat(
            self.tokenizer,
            messages,
            chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )

    # --- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._output_task, self._log_task):
            if task is not None and not task.done():
                task.cancel()
        error = EngineShutdownError("the engine was shut down before the request finished")
        for collector in self.collectors.values():
            collector.put(error)
        self.collectors.clear()
        try:
            self.engine_client.shutdown()
        finally:
            self.stat_loggers.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self._closed = True
                self.engine_client.shutdown()


def _aborted_output(request_id: str, states: list[RequestState], kind: OutputKind) -> RequestOutput:
    """The last output of a request aborted by a caller: finish reason abort, and nothing
    new (DELTA) or everything so far (CUMULATIVE)."""
    mine = [s for s in states if (s.parent.request_id if s.parent else s.request_id) == request_id]
    first = mine[0] if mine else None
    delta = kind is OutputKind.DELTA
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt if first else None,
        prompt_token_ids=first.prompt_token_ids if first else [],
        outputs=[
            CompletionOutput(
                index=s.index,
                text="" if delta else s.text,
                token_ids=[] if delta else list(s.token_ids),
                finish_reason="abort",
            )
            for s in mine
        ],
        finished=True,
    )
