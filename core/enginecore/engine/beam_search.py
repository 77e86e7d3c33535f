"""Beam search over the engine, as vLLM runs it: in the frontend, one step at a time.

Each step submits every live beam as a one-token request asking for ``2 * beam_width``
logprobs (the beams share their prefix, so prefix caching computes only the new token's
KV). Every candidate extension is scored by its cumulative logprob; one that ends in EOS
(unless ``ignore_eos``) is finished, the best ``beam_width`` of the others live on. When
``max_tokens`` steps are done (or no beam lives), the best ``beam_width`` of the finished
and live beams are returned, ranked by ``cum_logprob / len(tokens) ** length_penalty``
(``tokens`` include the prompt; a final EOS is not counted), as in vLLM.

:class:`BeamSearch` is the search's state and holds no engine: ``LLM.beam_search`` drives
it synchronously and :func:`beam_search_async` drives it on an ``AsyncLLM`` (the server's
``use_beam_search``), so both run the same algorithm.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from enginecore.engine.output import (
    CompletionOutput,
    Logprob,
    OutputKind,
    RequestOutput,
)
from enginecore.errors import InvalidRequestError
from enginecore.params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams of at most ``max_tokens`` tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """Passed to each step's one-token request; the search ranks candidates by their raw
    logprobs, so it only decides which extra sampled token joins the candidates."""
    length_penalty: float = 1.0
    """Exponent of the sequence length that divides the cumulative logprob in the final
    ranking (vLLM's and transformers' meaning)."""
    early_stopping: bool = False
    """True: a prompt's search ends once ``beam_width`` beams have finished (transformers'
    ``early_stopping=True``). False: it runs until ``max_tokens`` or until no beam lives."""
    include_stop_str_in_output: bool = False
    """Keep the EOS token's text at the end of a finished beam's text."""

    def __post_init__(self) -> None:
        checks = (
            ("beam_width", self.beam_width >= 1, "must be at least 1"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)}")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` include the prompt; ``text`` is the generated part's text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_ids: Sequence[int], length_penalty: float
) -> float:
    """vLLM's ranking: the cumulative logprob over the length (a final EOS not counted)
    to the power ``length_penalty``."""
    length = len(tokens)
    if tokens and tokens[-1] in eos_ids:
        length -= 1
    return cum_logprob / float(length**length_penalty)


@dataclass
class _Instance:
    """The search of one prompt."""

    prompt_len: int
    live: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    steps: int = 0


class BeamSearch:
    """The state of a beam search over several prompts (token ids each)."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: BeamSearchParams,
        eos_ids: Sequence[int],
        max_model_len: int,
    ) -> None:
        self.params = params
        self.eos_ids = list(eos_ids)
        self.max_model_len = max_model_len
        self.instances = [
            _Instance(prompt_len=len(p), live=[BeamSearchSequence(tokens=list(p))]) for p in prompts
        ]
        self.step_params = SamplingParams(
            max_tokens=1,
            logprobs=2 * params.beam_width,
            temperature=params.temperature,
            ignore_eos=True,  # the search decides what EOS means
        )
        self._pending: list[tuple[_Instance, BeamSearchSequence]] = []

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_ids, self.params.length_penalty
        )

    def _searching(self, inst: _Instance) -> bool:
        if not inst.live or inst.steps >= self.params.max_tokens:
            return False
        if len(inst.live[0].tokens) >= self.max_model_len:
            return False  # the context is full
        return not (self.params.early_stopping and len(inst.finished) >= self.params.beam_width)

    @property
    def done(self) -> bool:
        return not any(self._searching(inst) for inst in self.instances)

    def step_prompts(self) -> list[list[int]]:
        """Token ids of every beam to extend this step, in the order ``advance`` wants
        their outputs."""
        self._pending = [
            (inst, beam) for inst in self.instances if self._searching(inst) for beam in inst.live
        ]
        return [beam.tokens for _, beam in self._pending]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Fold in one step: ``outputs[i]`` is the one-token request of ``step_prompts()[i]``."""
        if len(outputs) != len(self._pending):
            raise ValueError(f"expected {len(self._pending)} outputs, got {len(outputs)}")
        candidates: dict[int, list[BeamSearchSequence]] = {}
        for (inst, beam), output in zip(self._pending, outputs, strict=True):
            step_logprobs = output.outputs[0].logprobs
            extended = candidates.setdefault(id(inst), [])
            if not step_logprobs:
                continue
            top = step_logprobs[0]
            for token_id, logprob in top.items():
                child = BeamSearchSequence(
                    tokens=[*beam.tokens, token_id],
                    logprobs=[*beam.logprobs, top],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos_ids and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    inst.finished.append(child)
                else:
                    extended.append(child)
        width = self.params.beam_width
        for inst in {id(i): i for i, _ in self._pending}.values():
            inst.steps += 1
            inst.live = sorted(candidates.get(id(inst), []), key=self._score, reverse=True)[:width]
            # Only the best ``width`` finished beams can be returned: keep no more.
            inst.finished = sorted(inst.finished, key=self._score, reverse=True)[:width]
        self._pending = []

    def results(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """The best ``beam_width`` beams of each prompt, best first, with their text."""
        outputs = []
        for inst in self.instances:
            best = sorted(inst.finished + inst.live, key=self._score, reverse=True)
            best = best[: self.params.beam_width]
            for beam in best:
                generated = beam.tokens[inst.prompt_len :]
                if beam.finish_reason is None:
                    beam.finish_reason = "length"
                elif not self.params.include_stop_str_in_output:
                    generated = generated[:-1]  # the EOS token's text is left out
                beam.text = tokenizer.decode(generated, skip_special_tokens=True)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs


def as_request_output(
    request_id: str, prompt_ids: list[int], result: BeamSearchOutput, n: int
) -> RequestOutput:
    """The best ``n`` beams of one prompt as a finished :class:`RequestOutput`, one
    completion per beam (so the server formats them like sampled choices)."""
    prompt_len = len(prompt_ids)
    completions = [
        CompletionOutput(
            index=index,
            text=beam.text or "",
            token_ids=beam.tokens[prompt_len:],
            cumulative_logprob=beam.cum_logprob,
            finish_reason=beam.finish_reason,
        )
        for index, beam in enumerate(result.sequences[:n])
    ]
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_ids,
        outputs=completions,
        finished=True,
    )


async def beam_search_async(
    engine: Any,
    prompt_ids: list[int],
    params: BeamSearchParams,
    *,
    request_id: str | None = None,
    priority: int = 0,
) -> BeamSearchOutput:
    """One prompt's beam search on an ``AsyncLLM``: each step's beams run as concurrent
    one-token requests (cancelling this aborts them)."""
    request_id = request_id or uuid.uuid4().hex
    search = BeamSearch([prompt_ids], params, engine.input_processor.eos_ids, engine.max_model_len)
    counter = itertools.count()

    async def one(tokens: list[int]) -> RequestOutput:
        collector = engine.add_request(
            f"{request_id}-beam{next(counter)}",
            {"prompt_token_ids": tokens},
            search.step_params,
            priority=priority,
            output_kind=OutputKind.FINAL_ONLY,
        )
        last: RequestOutput | None = None
        async for output in engine.stream(collector):
            last = output
        assert last is not None
        return last

    while not search.done:
        search.advance(await asyncio.gather(*(one(t) for t in search.step_prompts())))
    return search.results(engine.tokenizer)[0]
