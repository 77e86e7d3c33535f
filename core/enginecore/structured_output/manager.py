"""The engine core's side of structured output: compile, hold, mask, advance.

Requests with a constraint wait here (status ``WAITING_FOR_GRAMMAR``) while their
grammar compiles in a thread pool; the engine hands them to the scheduler once it is
ready, so a slow compile never holds up other requests and any scheduler plugin works
unchanged. Compiled grammars are cached by the constraint's text. Each step the engine
asks for the batch's bitmask while the forward pass runs, and advances each request's
grammar with the tokens it sampled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from enginecore.errors import InvalidRequestError, PluginContractError
from enginecore.plugin_attribution import with_attribution
from enginecore.plugins import is_builtin
from enginecore.request import Request, RequestStatus
from enginecore.scheduler_output import GrammarOutput, SchedulerOutput
from enginecore.startup_errors import describe_provider
from enginecore.structured_output.keys import grammar_key

if TYPE_CHECKING:
    from enginecore.config import EngineConfig
    from enginecore.interfaces import StructuredOutputBackend, StructuredOutputGrammar
    from enginecore.plugins import PluginHost
    from enginecore.protocol import EngineCoreOutputs
    from enginecore.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 1024  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2


class StructuredOutputManager:
    """Owns the backend, the compile pool and cache, and every request's grammar."""

    def __init__(self, config: EngineConfig, plugins: PluginHost) -> None:
        self.config = config
        self.backend_name = config.structured_output.backend
        self._registry = plugins.registry("structured_output_backend")
        # Fails at start-up, listing the available backends, when the name is unknown.
        self.backend_provider = self._registry.entry(self.backend_name).plugin
        #: A plugin's backend is named in its compile errors, with the config key.
        self.described = ""
        if not is_builtin(self.backend_provider):
            provider, _ = describe_provider(plugins, "structured_output_backend", self.backend_name)
            self.described = f" ({provider}, config key structured_output.backend)"
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._waiting: dict[str, tuple[Request, Future[Any]]] = {}
        self.grammars: dict[str, StructuredOutputGrammar] = {}
        # Requests whose output is still reasoning: unconstrained until the end marker.
        self.reasoning: dict[str, ReasoningGate] = {}
        #: Request id -> why its grammar failed while filling the bitmask (named).
        self._broken: dict[str, str] = {}
        self._words = 0  # bitmask width in int32 words, known once the backend is built

    # --- backend and compilation --------------------------------------------------------

    def _get_backend(self) -> StructuredOutputBackend:
        """Build the backend on first use (in a pool thread: it loads the tokenizer)."""
        with self._backend_lock:
            if self._backend is None:
                from enginecore.engine.input_processor import generation_eos_ids
                from enginecore.engine.tokenizer import load_tokenizer
                from enginecore.structured_output.vocab import model_vocab_size

                backend_cls = self._registry.get(self.backend_name)
                tokenizer = load_tokenizer(self.config)
                vocab_size = model_vocab_size(self.config, tokenizer)
                self._backend = backend_cls(
                    self.config,
                    tokenizer=tokenizer,
                    vocab_size=vocab_size,
                    eos_token_ids=generation_eos_ids(self.config, tokenizer),
                )
                self._words = (vocab_size + 31) // 32
            return self._backend

    def _compile(self, request: Request) -> Future[Any]:
        spec = request.sampling_params.structured_output
        assert spec is not None  # only requests with a constraint are compiled
        key = grammar_key(spec)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                COMPILE_THREADS, thread_name_prefix="enginecore-grammar"
            )
        future = self._pool.submit(lambda: self._get_backend().compile(spec))
        self._cache[key] = future
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    # --- requests -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits here until the grammar is ready."""
        request_id = request.request_id
        if request_id in self._waiting or request_id in self.grammars:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._waiting[request_id] = (request, self._compile(request))

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (in arrival order), and those that failed to compile."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[request_id]
            try:
                self.grammars[request_id] = self._get_backend().new_grammar(future.result())
            except Exception as exc:
                request.status = RequestStatus.FINISHED_ERROR
                message = compile_error_message(request, exc)
                failed.append((request, message + self.described))
                continue
            spec = request.sampling_params.structured_output
            if spec is not None and spec.reasoning_end:
                self.reasoning[request_id] = ReasoningGate(spec.reasoning_end)
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, failed

    def abort(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests still waiting for their grammar; forget any grammar of the ids."""
        finished = []
        for request_id in request_ids:
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None:
                waiting[0].status = status
                finished.append(waiting[0])
            self.grammars.pop(request_id, None)
            self.reasoning.pop(request_id, None)
            self._broken.pop(request_id, None)
        return finished

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    # --- the step -----------------------------------------------------------------------

    def grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The batch's bitmask: one row per structured request, plus one per draft token.

        A draft row is the mask after the drafts before it; the grammar is rolled back
        afterwards, so drafts the model rejects leave no trace. Rows after a draft the
        grammar rejects stay all-allowed: the sampler rejects that draft anyway.
        """
        request_ids = scheduler_output.structured_output_request_ids
        if not request_ids or not self.grammars:
            return None
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_rows = len(request_ids) + sum(len(drafts.get(r, ())) for r in request_ids)
        bitmask = np.full((num_rows, self._words), -1, dtype=np.int32)
        row = 0
        for request_id in request_ids:
            grammar = self.grammars.get(request_id)
            tokens = drafts.get(request_id, ())
            if grammar is None or request_id in self.reasoning:  # unconstrained rows
                row += 1 + len(tokens)
                continue
            advanced = 0
            for i in range(len(tokens) + 1):
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row + i)
                    if not bitmask[row + i].any():
                        self._allows_nothing(request_id, grammar, bitmask, row + i)
                if i == len(tokens) or not grammar.accept_tokens(tokens[i : i + 1]):
                    break
                advanced += 1
            if advanced:
                grammar.rollback(advanced)
            row += 1 + len(tokens)
        return GrammarOutput(
            structured_output_request_ids=list(request_ids), grammar_bitmask=bitmask
        )

    def _allows_nothing(
        self, request_id: str, grammar: StructuredOutputGrammar, bitmask: np.ndarray, row: int
    ) -> None:
        """A row the grammar cleared: the sampler would pick from no token at all (an
        arbitrary one). The row is opened again and the request fails, naming the method."""
        bitmask[row] = -1
        method = type(grammar).fill_bitmask
        error = PluginContractError(
            f"the {self.backend_name!r} grammar's {type(grammar).__qualname__}.fill_bitmask "
            "wrote a row that allows no token (a grammar that is not terminated must allow "
            f"at least one){self.described}",
            origin=method,
        )
        self._broken[request_id] = with_attribution(error, str(error))

    def accept_sampled(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> GrammarAdvance:
        """Feed each grammar the tokens its request sampled in this batch.

        Returns the requests whose grammar rejected a token (a sampler plugin overrode
        the mask: the engine finishes those with an error) and those whose grammar ended
        (accepted its stop token, e.g. under ``ignore_eos``: the engine finishes those
        with ``stop``, keeping only the tokens up to and including the end).
        """
        advance = GrammarAdvance()
        grammars = self.grammars
        if not grammars:
            return advance
        for request_id in [r for r in self._broken if r in grammars]:
            del grammars[request_id]
            advance.rejected.append((request_id, self._broken.pop(request_id)))
        index = runner_output.req_id_to_index
        sampled = runner_output.sampled_token_ids
        for request_id in scheduler_output.structured_output_request_ids:
            grammar = grammars.get(request_id)
            i = index.get(request_id)
            if grammar is None or i is None or not sampled[i]:
                continue
            tokens = sampled[i]
            gate = self.reasoning.get(request_id)
            if gate is not None:
                answer = gate.after_end(tokens)
                if answer is None:
                    continue  # still reasoning
                del self.reasoning[request_id]
                if not answer:
                    continue
                tokens = answer
            taken = _advance(grammar, tokens)
            if taken is None:
                del grammars[request_id]
                message = f"the {self.backend_name!r} grammar rejected sampled tokens {tokens}"
                advance.rejected.append((request_id, message))
            elif grammar.is_terminated():
                advance.ended[request_id] = len(sampled[i]) - len(tokens) + taken
        return advance

    def release_finished(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Drop the grammars of requests that finished in this step."""
        if not self.grammars:
            return
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                if output.finish_reason is not None:
                    self.grammars.pop(output.request_id, None)
                    self.reasoning.pop(output.request_id, None)
                    self._broken.pop(output.request_id, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()


@dataclass
class GrammarAdvance:
    """What one batch's sampled tokens did to the grammars (:meth:`accept_sampled`)."""

    #: ``(request_id, message)`` for each grammar that rejected a sampled token.
    rejected: list[tuple[str, str]] = field(default_factory=list)
    #: Request id -> how many of the step's sampled tokens come up to and including the
    #: grammar's end (tokens after it were sampled past a complete output).
    ended: dict[str, int] = field(default_factory=dict)


def _advance(grammar: StructuredOutputGrammar, tokens: list[int]) -> int | None:
    """How many of ``tokens`` the grammar took: all of them, or those up to and
    including its end when the rest run past it; None when it rejected one."""
    if grammar.accept_tokens(tokens):
        return len(tokens)
    # Several tokens in one step (drafts) may run past the end: take them one by one.
    taken = 0
    for token in tokens:
        if grammar.is_terminated():
            return taken
        if not grammar.accept_tokens([token]):
            break
        taken += 1
    if taken:
        grammar.rollback(taken)
    return None


class ReasoningGate:
    """Watches a reasoning request's sampled tokens for an end-of-reasoning sequence."""

    def __init__(self, ends: list[list[int]]) -> None:
        self.ends = [list(end) for end in ends if end]
        self.keep = max((len(end) for end in self.ends), default=1) - 1
        self.recent: list[int] = []  # the last tokens seen, as many as a marker could span

    def after_end(self, tokens: list[int]) -> list[int] | None:
        """The tokens after the first complete end sequence; None while there is none."""
        window = self.recent + list(tokens)
        for start in range(len(window)):
            for end in self.ends:
                if window[start : start + len(end)] == end:
                    return window[start + len(end) :]
        self.recent = window[len(window) - self.keep :] if self.keep else []
        return None


def compile_error_message(request: Request, exc: BaseException) -> str:
    """What the user sees when a grammar cannot be built: the backend's own message."""
    if isinstance(exc, InvalidRequestError):
        return str(exc)
    spec = request.sampling_params.structured_output
    assert spec is not None  # only requests with a constraint are compiled
    kind = grammar_key(spec)[0]
    return f"the {kind} constraint could not be compiled: {type(exc).__name__}: {exc}"
