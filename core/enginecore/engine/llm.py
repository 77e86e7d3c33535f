"""``LLM``: the offline, synchronous API (shaped like vLLM's so user code carries over)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from enginecore.component_check import check_components
from enginecore.config import EngineConfig, make_config
from enginecore.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from enginecore.engine.chat_template import Message, render_chat
from enginecore.engine.client import EngineCoreClient, start_engine
from enginecore.engine.dp_coordinator import check_data_parallel_rank
from enginecore.engine.input_processor import InputProcessor, PromptType
from enginecore.engine.lora_names import LoRANames
from enginecore.engine.model_defaults import configured_chat_template, sampling_defaults
from enginecore.engine.output import OutputKind, OutputProcessor, RequestOutput
from enginecore.engine.pooling_api import PoolingMethods
from enginecore.errors import ConfigError, EngineDeadError, InvalidRequestError
from enginecore.hub import resolve_model
from enginecore.interfaces import IterationStats
from enginecore.lora_request import LoRARequest
from enginecore.metrics.iteration import IterationStatsBuilder, finished_request_stats
from enginecore.metrics.manager import StatLoggerManager
from enginecore.params import SamplingParams
from enginecore.plugins import PluginHost, make_plugin_manager
from enginecore.request import FinishReason

logger = logging.getLogger(__name__)


class LLM(PoolingMethods):
    """Generate text offline: ``LLM(model="path").generate(prompts, SamplingParams(...))``.

    Every config field is a keyword (``max_num_seqs=64``, ``dtype="float32"``, ...); a whole
    section may be passed as a dict, or a complete ``config=EngineConfig(...)``.
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
        self._closed = True  # until the engine runs: nothing to shut down
        self.config = resolve_model(make_config(config_file, base=config, **overrides))
        self.plugins = plugin_host or make_plugin_manager(
            self.config.plugins.enabled, self.config.plugins.disabled
        )
        check_components(self.config, self.plugins)  # every bad name at once, before any process
        # Built before the engine (as under AsyncLLM) so that a bad logger fails in seconds.
        self.stat_loggers = StatLoggerManager(self.config, self.plugins)
        self.default_sampling = sampling_defaults(self.config)
        self.chat_template = configured_chat_template(self.config)
        self.engine_client: EngineCoreClient
        try:
            self.engine_client, self.tokenizer = start_engine(self.config, plugins=self.plugins)
        except BaseException:
            self.stat_loggers.close()
            raise
        self._closed = False
        self.max_model_len = self.engine_client.ready.max_model_len
        self.input_processor = InputProcessor(
            self.config, self.tokenizer, self.max_model_len, self.plugins
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self._lora_names = LoRANames()
        self._next_log = time.monotonic() + self.config.observability.log_stats_interval
        self.stat_loggers.log_engine_initialized(self.engine_client.ready)

    # --- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        data_parallel_rank: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in input order.

        A prompt is a ``str``, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        Every prompt is validated before any is scheduled. ``data_parallel_rank`` (one,
        or one per prompt) sends prompts to named replicas instead of balancing them.
        With data parallelism, a replica that dies fails this call with
        ``EngineDeadError``; later calls run on the replicas that live.
        ``lora_request`` (one, or one per prompt, None for the base model) serves
        prompts with LoRA adapters (``enable_lora``).
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidRequestError("priority needs one value per prompt")
        ranks = self._as_rank_list(data_parallel_rank, len(prompt_list))
        loras = self._as_lora_list(lora_request, len(prompt_list))
        self._lora_names.use(loras)
        states = self._validate_all(prompt_list, params_list, priority, loras)
        for (request, _), rank in zip(states, ranks, strict=True):
            request.data_parallel_rank = rank
        request_ids = []
        try:
            for state in states:
                request_ids.append(self._add(*state))
        except BaseException:  # e.g. a named replica is dead: nothing stays behind
            all_ids = [request.request_id for request, _ in states]
            self.engine_client.abort_requests(self.output_processor.abort_requests(all_ids))
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` beams of each prompt
        (``BeamSearchOutput.sequences``, best first, each with ``tokens`` (prompt
        included), ``text`` and ``cum_logprob``). Each step runs every live beam of every
        prompt as one batch of one-token requests (see :mod:`enginecore.engine.beam_search`)."""
        token_prompts = []
        for i, prompt in enumerate(self._as_prompt_list(prompts)):
            try:
                _, token_ids = self.input_processor.tokenize(prompt)
                self.input_processor.validate_tokens(token_ids, SamplingParams())
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {i}: {exc}") from None
            token_prompts.append(token_ids)
        search = BeamSearch(token_prompts, params, self.input_processor.eos_ids, self.max_model_len)
        progress = _progress(params.max_tokens, desc="Beam search steps") if use_tqdm else None
        try:
            while not search.done:
                step = [{"prompt_token_ids": tokens} for tokens in search.step_prompts()]
                search.advance(self.generate(step, search.step_params, use_tqdm=False))
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return search.results(self.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without ``sampling_params``: the checkpoint's
        generation_config.json values (config ``model.generation_config``), as vLLM's."""
        return SamplingParams(**self.default_sampling)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation (as the server's chat route does),
        then generate.

        ``tools`` (OpenAI function definitions) are passed to the template, like vLLM's
        ``LLM.chat(tools=...)``; the reply is returned as text (parse tool calls with an
        :mod:`enginecore.tool_parsers` parser). ``continue_final_message`` leaves the last
        message open for the reply to continue."""
        if tools:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        one = not (messages and isinstance(messages[0], list))
        conversations = cast(list[list[Message]], [messages] if one else messages)
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": render_chat(
                    self.tokenizer,
                    conversation,
                    chat_template=chat_template or self.chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _as_prompt_list(self, prompts: Any) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        prompt_list = list(prompts)
        if not prompt_list:
            raise InvalidRequestError("no prompts given")
        return prompt_list

    @staticmethod
    def _as_lora_list(lora_request: Any, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise InvalidRequestError(
                f"got {len(loras)} lora_request values for {n} prompts: give one or one per prompt"
            )
        return loras

    def _as_rank_list(self, ranks: Any, n: int) -> list[int | None]:
        rank_list = list(ranks) if isinstance(ranks, Sequence) else [ranks] * n
        if len(rank_list) != n:
            raise InvalidRequestError(
                f"got {len(rank_list)} data_parallel_rank values for {n} prompts: "
                "give one or one per prompt"
            )
        par = self.config.parallel
        for rank in rank_list:
            check_data_parallel_rank(par.data_parallel_size, par.data_parallel_external_lb, rank)
        return rank_list

    @staticmethod
    def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params_list: list[SamplingParams] = list(params)
        if len(params_list) != n:
            raise InvalidRequestError(
                f"got {len(params_list)} SamplingParams for {n} prompts: give one or one per prompt"
            )
        return params_list

    def _validate_all(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        priority: Sequence[int] | None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[tuple[Any, str | None]]:
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            request_id = str(next(self._request_counter))
            try:
                request, text = self.input_processor.process(
                    request_id,
                    prompt,
                    params,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i] if loras else None,
                )
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {i}: {exc}") from None
            prepared.append((request, text))
        return prepared

    def _add(self, request: Any, text: str | None) -> str:
        for engine_request in self.output_processor.add_engine_request(
            request, text, output_kind=OutputKind.FINAL_ONLY
        ):
            self.engine_client.add_request(engine_request)
        request_id: str = request.request_id
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(request_ids)) if use_tqdm else None
        try:
            while len(finished) < len(wanted):
                engine_outputs = self.engine_client.get_output()
                if engine_outputs.engine_dead is not None:  # one data-parallel replica
                    lost = engine_outputs.finished_requests or set()
                    if lost & set(self.output_processor.states):
                        raise EngineDeadError(engine_outputs.engine_dead)
                    continue
                ready, to_abort = self._process_step(engine_outputs)
                self.engine_client.abort_requests(to_abort)
                for _, output in ready:
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                if (
                    not engine_outputs.outputs
                    and not engine_outputs.plain_req_ids
                    and not self.output_processor.has_unfinished_requests()
                ):
                    break
        except BaseException:
            self._abort([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            if progress is not None:
                progress.close()
        # The steps' records were handed to the stat loggers without waiting: once the
        # call returns, their metrics count every step of it.
        self.stat_loggers.flush()
        return [finished[rid] for rid in request_ids if rid in finished]

    def _process_step(self, engine_outputs: Any) -> tuple[list[Any], list[str]]:
        """Fold one step's outputs in (with their statistics, as
        :class:`~enginecore.AsyncLLM` does: ``OutputProcessor.process_outputs``) and feed
        the stat loggers and ``request_finished``."""
        now = time.monotonic()
        builder = IterationStatsBuilder(now)
        ready, to_abort = self.output_processor.process_outputs(
            engine_outputs.outputs, now, builder
        )
        if engine_outputs.plain_req_ids:
            more, more_to_abort = self.output_processor.process_plain(
                engine_outputs.plain_req_ids, engine_outputs.plain_token_ids, now, builder
            )
            ready += more
            to_abort += more_to_abort
        self.stat_loggers.record(
            engine_outputs.scheduler_stats, builder.stats, engine_outputs.engine_index
        )
        for finished in builder.stats.finished_requests:
            self.plugins.request_finished(finished)
        interval = self.config.observability.log_stats_interval
        if interval > 0 and now >= self._next_log:
            self._next_log = now + interval
            self.stat_loggers.log()
        return ready, to_abort

    # --- control -----------------------------------------------------------------------

    def abort(self, request_ids: str | Sequence[str]) -> None:
        self._abort([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def _abort(self, ids: list[str]) -> None:
        """Abort in the frontend and the engine; the aborted requests reach the stat
        loggers and ``request_finished`` with finish reason abort, as under AsyncLLM."""
        now = time.monotonic()
        states = self.output_processor.states_of(ids)
        self.engine_client.abort_requests(self.output_processor.abort_requests(ids))
        if states:
            stats = IterationStats(timestamp=now)
            stats.finished_requests = [
                finished_request_stats(s, now, FinishReason.ABORT) for s in states
            ]
            self.stat_loggers.record(None, stats)
            for finished in stats.finished_requests:
                self.plugins.request_finished(finished)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every worker; one result per rank."""
        results: list[Any] = self.engine_client.call_utility(
            "collective_rpc", method, timeout, args, kwargs
        )
        return results

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read a LoRA adapter into every worker now, before a request names it (vLLM's
        ``add_lora``); raises with the reason when it cannot be read. Also brings back a
        name :meth:`remove_lora` removed."""
        added = bool(
            self._lora_call(
                "add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path
            )
        )
        self._lora_names.added(lora_request)
        return added

    def remove_lora(self, lora_name: str) -> bool:
        """Unload the LoRA adapter served as ``lora_name`` (as the server's
        ``/v1/unload_lora_adapter``): requests already sent with it (from a
        ``generate`` running in another thread) finish with it; returns once every
        worker has freed its device slot and host copy. A request naming it afterwards
        is refused until :meth:`add_lora` loads it again."""
        self._lora_calls_possible("remove_lora")
        ids = self._lora_names.remove(lora_name)
        return all([bool(self._lora_call("remove_lora", lora_int_id)) for lora_int_id in ids])

    def _lora_calls_possible(self, method: str) -> None:
        from enginecore.engine.client import InprocClient

        if isinstance(self.engine_client, InprocClient):
            raise ConfigError(
                f"LLM.{method} needs the engine core in its own process: it is off "
                "(multiprocessing = false, or the external_launcher executor)"
            )

    def _lora_call(self, method: str, *args: Any) -> Any:
        self._lora_calls_possible(method)
        return self.engine_client.call_utility(method, *args)

    def reset_prefix_cache(self) -> bool:
        reset: bool = self.engine_client.call_utility("reset_prefix_cache")
        return reset

    def sleep(self, level: int = 1) -> None:
        """Release device memory between batches (vLLM's ``LLM.sleep``): level 1 frees the
        KV cache, level 2 the weights too. :meth:`wake_up` restores them."""
        self.engine_client.call_utility("sleep", level)

    def wake_up(self) -> None:
        self.engine_client.call_utility("wake_up")

    def is_sleeping(self) -> bool:
        asleep: bool = self.engine_client.call_utility("is_sleeping")
        return asleep

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.engine_client.shutdown()
            finally:
                self.stat_loggers.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()


def _progress(total: int, desc: str = "Processed prompts") -> Any:
    """vLLM's progress bar (on stderr): prompts (or steps) done, and their rate."""
    from tqdm import tqdm

    unit = "prompt" if desc == "Processed prompts" else "step"
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
