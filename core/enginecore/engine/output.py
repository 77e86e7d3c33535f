"""Frontend output processing: engine-core outputs -> RequestOutput objects users see."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from enginecore.engine.detokenizer import IncrementalDetokenizer
from enginecore.engine.piece_table import build_in_background
from enginecore.metrics.iteration import IterationStatsBuilder, TokenTimes, finished_request_stats
from enginecore.params import SamplingParams
from enginecore.protocol import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest
from enginecore.request import FinishReason

#: Plain steps' tokens a request queues for its detokenizer (see
#: :attr:`RequestState.queued_ids`) before they are folded into its text on the step:
#: between this and twice this, per request. The text of a request that finishes sooner
#: is built once, when it is read.
FOLD_AT = 512


class OutputKind(enum.Enum):
    FINAL_ONLY = 0  # one RequestOutput when the request finishes (LLM.generate)
    CUMULATIVE = 1  # every step: everything so far
    DELTA = 2  # every step: only what is new


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    # Streaming (DELTA) sends them once, in the first output that has them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set by a KV connector when the request finishes (disaggregated prefill: the
    # handle a decode instance passes back in its SamplingParams.kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None
    # Why the engine failed the request (finish_reason "error"), e.g. a KV load error.
    error: str | None = None
    # A pooling request's vector (its only output; ``outputs`` then holds no tokens).
    pooled: list[float] | None = None


@dataclass
class RequestTimes:
    arrival: float
    queued: float | None = None  # engine-core clock from here on
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class RequestState:
    """What the frontend tracks for one engine request (one child when n > 1)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        *,
        output_kind: OutputKind,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = output_kind
        self.parent = parent
        self.index = index
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer(tokenizer, params) if tokenizer else None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._sent_prompt_logprobs = False
        self.num_preemptions = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.error: str | None = None
        self.pooled: list[float] | None = None
        self.times = RequestTimes(arrival=time.monotonic())
        self._sent_text = 0
        self._sent_tokens = 0
        # Whether a plain step (one token, nothing else) may take the fast path of
        # OutputProcessor.process_outputs: no logprobs, no stop strings to search for.
        self.plain = self.logprobs is None and (
            self.detokenizer is None or self.detokenizer.streams_plainly
        )
        # Whether a step that does not finish it still makes a RequestOutput.
        self.streams_every_step = output_kind is not OutputKind.FINAL_ONLY or parent is not None
        # Where a plain step's token goes for the detokenizer when its text is not read
        # every step: queued, its text folded in when read.
        self.queued_ids: list[int] | None = (
            self.detokenizer.queued
            if self.detokenizer is not None
            and self.detokenizer.streams_plainly
            and not self.streams_every_step
            else None
        )
        # Queued tokens past which they are folded in on the step (a request's finish then
        # folds at most this many): staggered per request, so that requests that started
        # together do not all fold on one step.
        self.fold_at = FOLD_AT + hash(request_id) % FOLD_AT

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    def fold_queued(self) -> None:
        """Fold the tokens queued for the detokenizer into the text now."""
        if self.detokenizer is not None:
            self.detokenizer.fold_queued()

    def apply_token(self, token_id: int, now: float) -> None:
        """:meth:`apply` for a plain step of a :attr:`plain` request past its first token:
        one new token and nothing else (no events, no finish, no logprobs)."""
        if self.queued_ids is not None:
            self.queued_ids.append(token_id)
        elif self.detokenizer is not None:
            self.detokenizer.add_token_to_text(token_id)
        self.times.last_token = now
        self.token_ids.append(token_id)

    def apply(self, out: EngineCoreOutput, now: float) -> str | None:
        """Fold one step's output in. Returns a stop string if one was found."""
        new_ids = out.new_token_ids
        for event_type, timestamp in out.events or ():
            if event_type == EngineCoreEventType.QUEUED:
                self.times.queued = timestamp
            elif event_type == EngineCoreEventType.SCHEDULED and self.times.scheduled is None:
                self.times.scheduled = timestamp
            elif event_type == EngineCoreEventType.PREEMPTED:
                self.num_preemptions += 1
        stop_string = None
        if self.detokenizer is not None and new_ids:
            text_ids = new_ids
            if self._ends_on_special_stop_token(out):
                text_ids = new_ids[:-1]  # as vLLM: the EOS is in token_ids, not in the text
            stop_string, num_kept = self._detokenize(text_ids) if text_ids else (None, 0)
            if stop_string is not None:
                new_ids = new_ids[:num_kept]
        if new_ids:
            if self.times.first_token is None:
                self.times.first_token = now
                self.num_cached_tokens = out.num_cached_tokens
            self.times.last_token = now
            self.token_ids.extend(new_ids)
            if self.logprobs is not None and out.new_logprobs is not None:
                self._add_logprobs(out, len(new_ids))
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self._set_prompt_logprobs(out)
        if stop_string is not None:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = stop_string
        elif out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.error is not None:
            self.error = out.error
        if out.pooling_output is not None:
            self.pooled = out.pooling_output
        if self.finish_reason is not None:
            self.times.finished = now
        return stop_string

    def _ends_on_special_stop_token(self, out: EngineCoreOutput) -> bool:
        """Finished by EOS (or a stop token id) that is a special token, while special
        tokens are detokenized (``skip_special_tokens`` off, as for a parser whose markers
        are special tokens): that token's text must not end the reply."""
        detokenizer = self.detokenizer
        if detokenizer is None or detokenizer.skip_special_tokens:
            return False
        if out.finish_reason != FinishReason.STOP or isinstance(out.stop_reason, str):
            return False
        special = getattr(detokenizer.tokenizer, "all_special_ids", None) or ()
        return out.new_token_ids[-1] in special

    def _detokenize(self, new_ids: list[int]) -> tuple[str | None, int]:
        """Detokenize a step's tokens: ``(stop string found, tokens kept)``.

        A step carries several tokens with speculative decoding. Stop strings are then
        checked token by token, as a one-token step would, so that the tokens after the
        one completing a stop string are dropped: the output is the same either way.
        """
        detokenizer = self.detokenizer
        assert detokenizer is not None
        if len(new_ids) == 1 or not detokenizer.stop:
            return detokenizer.update(new_ids), len(new_ids)
        for index, token in enumerate(new_ids):
            stop_string = detokenizer.update([token])
            if stop_string is not None:
                return stop_string, index + 1
        return None, len(new_ids)

    def _add_logprobs(self, out: EngineCoreOutput, num_tokens: int) -> None:
        # Called only for a request that asked for logprobs: both are set.
        assert self.logprobs is not None and self.cumulative_logprob is not None
        decode = self.detokenizer.decode_token if self.detokenizer else (lambda _: None)
        for ids, lps, rank in zip(
            (out.new_logprob_token_ids or [])[:num_tokens],
            (out.new_logprobs or [])[:num_tokens],
            (out.new_sampled_ranks or [])[:num_tokens],
            strict=False,
        ):
            entry: dict[int, Logprob] = {}
            for pos, (token_id, lp) in enumerate(zip(ids, lps, strict=False)):
                if token_id in entry:
                    continue
                entry[token_id] = Logprob(lp, rank if pos == 0 else pos, decode(token_id))
            self.logprobs.append(entry)
            self.cumulative_logprob += lps[0] if lps else 0.0

    def _set_prompt_logprobs(self, out: EngineCoreOutput) -> None:
        decode = self.detokenizer.decode_token if self.detokenizer else (lambda _: None)
        entries: list[dict[int, Logprob] | None] = [None]
        scored = out.prompt_logprobs
        assert scored is not None  # called only for an output that carries them
        for ids, lps, rank in zip(scored.token_ids, scored.logprobs, scored.ranks, strict=True):
            entry: dict[int, Logprob] = {}
            for pos, (token_id, lp) in enumerate(zip(ids, lps, strict=True)):
                if token_id not in entry:
                    entry[token_id] = Logprob(lp, rank if pos == 0 else pos, decode(token_id))
            entries.append(entry)
        self.prompt_logprobs = entries

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs for the next RequestOutput (once only when streaming deltas)."""
        if self.output_kind is OutputKind.DELTA:
            if self._sent_prompt_logprobs or self.prompt_logprobs is None:
                return None
            self._sent_prompt_logprobs = True
        return self.prompt_logprobs

    def completion(self) -> CompletionOutput:
        finished = self.finish_reason is not None
        text, token_ids, logprobs = self.text, self.token_ids, self.logprobs
        if not finished and self.detokenizer is not None and self.detokenizer.stop_holdback:
            # Streaming: text that may be the start of a stop string is sent only once it
            # is known not to be (a stop string found later cuts it from the output).
            text = text[: max(len(text) - self.detokenizer.stop_holdback, self._sent_text)]
        if self.output_kind is OutputKind.DELTA:
            text = text[self._sent_text :]
            token_ids = token_ids[self._sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[self._sent_tokens :]
            self._sent_text += len(text)
            self._sent_tokens += len(token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=str(self.finish_reason) if finished else None,
            stop_reason=self.stop_reason,
        )

    def metrics(self) -> dict[str, float]:
        t = self.times
        metrics = {"arrival_time": t.arrival, "num_preemptions": self.num_preemptions}
        if t.queued is not None and t.scheduled is not None:
            metrics["queued_time"] = t.scheduled - t.queued
        if t.first_token is not None:
            metrics["time_to_first_token"] = t.first_token - t.arrival
        if t.finished is not None:
            metrics["e2e_latency"] = t.finished - t.arrival
        return metrics


class ParentRequest:
    """Fans one user request with ``n > 1`` out into n engine requests and merges them."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.children: list[RequestState | None] = [None] * n
        self.num_finished = 0

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        # Distinct seeds keep seeded parallel samples different yet reproducible.
        seed = None if params.seed is None else params.seed + index
        return params.clone(n=1, seed=seed)

    @staticmethod
    def child_id(request_id: str, index: int) -> str:
        return f"{index}_{request_id}"


def _is_plain_step(out: EngineCoreOutput) -> bool:
    """One new token and nothing else: no finish, no events, no logprobs or other payload."""
    return (
        len(out.new_token_ids) == 1
        and out.finish_reason is None
        and out.events is None
        and out.new_logprob_token_ids is None
        and out.prompt_logprobs is None
        and out.kv_transfer_params is None
        and out.error is None
        and out.pooling_output is None
    )


class OutputProcessor:
    """Folds each step's EngineCoreOutputs into per-request state and builds RequestOutputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:  # built off start-up rather than on a request's step
            build_in_background(tokenizer)
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # Plain rows folded in by process_plain's one pass (read by tests).
        self.num_plain_rows = 0

    def add_request(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        self.states[state.request_id] = state
        if state.parent is not None:
            self.parents[state.parent.request_id] = state.parent
            state.parent.children[state.index] = state

    def add_engine_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        *,
        output_kind: OutputKind,
        queue: Any = None,
    ) -> list[EngineCoreRequest]:
        """Track one user request; returns the engine requests to send (n of them if n > 1)."""
        params = request.sampling_params
        if params.n == 1:
            self.add_request(
                RequestState(
                    request.request_id,
                    prompt,
                    request.prompt_token_ids,
                    params,
                    self.tokenizer,
                    output_kind=output_kind,
                    queue=queue,
                )
            )
            return [request]
        parent = ParentRequest(request.request_id, params.n)
        children = []
        for index in range(params.n):
            child = msgspec.structs.replace(
                request,
                request_id=ParentRequest.child_id(request.request_id, index),
                sampling_params=ParentRequest.child_params(params, index),
            )
            self.add_request(
                RequestState(
                    child.request_id,
                    prompt,
                    request.prompt_token_ids,
                    child.sampling_params,
                    self.tokenizer,
                    output_kind=output_kind,
                    parent=parent,
                    index=index,
                    queue=queue,
                )
            )
            children.append(child)
        return children

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    def states_of(self, request_ids: list[str]) -> list[RequestState]:
        """The live states behind user-facing ids (each sample of an ``n > 1`` request)."""
        states = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is not None:
                states += [
                    c for c in parent.children if c is not None and c.request_id in self.states
                ]
            elif request_id in self.states:
                states.append(self.states[request_id])
        return states

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Drop frontend state first; return the engine request ids to abort."""
        engine_ids = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                for child in parent.children:
                    if child is not None and self.states.pop(child.request_id, None) is not None:
                        engine_ids.append(child.request_id)
            elif self.states.pop(rid, None) is not None:
                engine_ids.append(rid)
        return engine_ids

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        now: float | None = None,
        stats: IterationStatsBuilder | None = None,
    ) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """Returns ``(ready outputs with their state, engine ids to abort for stop strings)``;
        records each request's new tokens and finish in ``stats`` (both frontends' path)."""
        now = time.monotonic() if now is None else now
        ready: list[tuple[RequestState, RequestOutput]] = []
        to_abort: list[str] = []
        states = self.states
        gaps: list[float] = []  # inter-token latencies of the plain steps, for ``stats``
        for out in outputs:
            state = states.get(out.request_id)
            if state is None:
                continue  # aborted in the frontend meanwhile
            times = state.times
            last_token = times.last_token
            if state.plain and last_token is not None and _is_plain_step(out):
                # Most of a decode step's outputs: one token, nothing else.
                gaps.append(now - last_token)
                state.apply_token(out.new_token_ids[0], now)
                if state.streams_every_step:
                    request_output = self._make_output(state, False)
                    if request_output is not None:
                        ready.append((state, request_output))
                continue
            before = TokenTimes(state) if stats is not None else None
            if state.apply(out, now) is not None and out.finish_reason is None:
                to_abort.append(out.request_id)  # the engine does not know yet
            if stats is not None and before is not None:
                stats.observe(state, before, now)
                if state.finish_reason is not None:
                    stats.finish(finished_request_stats(state, now), state)
            finished = state.finish_reason is not None
            if finished:
                del self.states[out.request_id]
            request_output = self._make_output(state, finished)
            if request_output is not None:
                ready.append((state, request_output))
        if stats is not None and gaps:
            stats.next_tokens(gaps)
        return ready, to_abort

    def process_plain(
        self,
        request_ids: list[str],
        token_ids: list[int],
        now: float,
        stats: IterationStatsBuilder | None = None,
    ) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """:meth:`process_outputs` for a step's plain rows (``EngineCoreOutputs.
        plain_req_ids``): one token each and nothing else, folded in one pass; a request
        that needs more than the token appended (stop strings, logprobs) takes the
        general path."""
        ready: list[tuple[RequestState, RequestOutput]] = []
        to_abort: list[str] = []
        gaps: list[float] = []
        general: list[EngineCoreOutput] = []
        for state, token_id in zip(map(self.states.get, request_ids), token_ids, strict=True):
            if state is None:
                continue  # aborted in the frontend meanwhile
            times = state.times
            last_token = times.last_token
            if last_token is None or not state.plain:
                general.append(
                    EngineCoreOutput(request_id=state.request_id, new_token_ids=[token_id])
                )
                continue
            gaps.append(now - last_token)
            # RequestState.apply_token, inlined: this loop runs once per request per step.
            times.last_token = now
            state.token_ids.append(token_id)
            queued_ids = state.queued_ids
            if queued_ids is not None:
                queued_ids.append(token_id)  # detokenized when its text is read
                if len(queued_ids) >= state.fold_at:
                    state.fold_queued()
            elif (detokenizer := state.detokenizer) is not None:
                detokenizer.add_token_to_text(token_id)
            if state.streams_every_step:
                request_output = self._make_output(state, False)
                if request_output is not None:
                    ready.append((state, request_output))
        self.num_plain_rows += len(request_ids) - len(general)
        if stats is not None and gaps:
            stats.next_tokens(gaps)
        if general:
            more, to_abort = self.process_outputs(general, now, stats)
            ready += more
        return ready, to_abort

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput | None:
        parent = state.parent
        if parent is None:
            if state.output_kind is OutputKind.FINAL_ONLY and not finished:
                return None
            return RequestOutput(
                request_id=state.request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                outputs=[state.completion()],
                finished=finished,
                num_cached_tokens=state.num_cached_tokens,
                metrics=state.metrics(),
                prompt_logprobs=state.take_prompt_logprobs(),
                kv_transfer_params=state.kv_transfer_params,
                error=state.error,
                pooled=state.pooled,
            )
        if finished:
            parent.num_finished += 1
        all_done = parent.num_finished == len(parent.children)
        if all_done:
            self.parents.pop(parent.request_id, None)
        if state.output_kind is OutputKind.FINAL_ONLY:
            if not all_done:
                return None
            completions = [c.completion() for c in parent.children if c is not None]
            # Every child scored the same prompt: report the first child's.
            prompt_logprobs = next(
                (c.prompt_logprobs for c in parent.children if c and c.prompt_logprobs), None
            )
        else:
            completions = [state.completion()]
            prompt_logprobs = state.take_prompt_logprobs()
        return RequestOutput(
            request_id=parent.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=all_done,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics(),
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=state.kv_transfer_params,
            error=state.error,
        )
