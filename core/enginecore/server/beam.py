"""``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's extension).

The search itself is :mod:`enginecore.engine.beam_search`, shared with ``LLM.beam_search``;
this module checks the request and turns each prompt's best beams into a finished
:class:`RequestOutput`, which the routes format (and stream) like sampled choices.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from enginecore.engine.beam_search import BeamSearchParams, as_request_output, beam_search_async
from enginecore.engine.output import RequestOutput
from enginecore.errors import InvalidRequestError
from enginecore.server.errors import APIError
from enginecore.server.protocol import SamplingFields


def _conflicts(req: SamplingFields, logprobs: bool) -> list[str]:
    """Request fields that sampling honours and beam search cannot (vLLM ignores them)."""
    given = {
        "top_p": req.top_p not in (None, 1.0),
        "top_k": req.top_k not in (None, 0, -1),
        "min_p": req.min_p not in (None, 0.0),
        "presence_penalty": req.presence_penalty != 0.0,
        "frequency_penalty": req.frequency_penalty != 0.0,
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(req.logit_bias),
        "stop": bool(req.stop),
        "stop_token_ids": bool(req.stop_token_ids),
        "min_tokens": req.min_tokens > 0,
        "logprobs": logprobs,
        "prompt_logprobs": getattr(req, "prompt_logprobs", None) is not None,
        "response_format": req.response_format is not None and req.response_format.type != "text",
        "structured_outputs": req.structured_outputs is not None,
        "guided_json": req.guided_json is not None,
        "guided_regex": req.guided_regex is not None,
        "guided_choice": req.guided_choice is not None,
        "guided_grammar": req.guided_grammar is not None,
        "kv_transfer_params": req.kv_transfer_params is not None,
    }
    return [name for name, set_ in given.items() if set_]


def beam_search_params(
    req: SamplingFields,
    *,
    beam_width: int,
    max_tokens: int,
    logprobs: bool,
) -> BeamSearchParams:
    """The request's beam search; a field beam search cannot honour is a 400 naming it."""
    conflicts = _conflicts(req, logprobs)
    if conflicts:
        raise APIError(
            400,
            f"{conflicts[0]} cannot be combined with use_beam_search (beam search ranks beams "
            "by their raw logprobs; leave out: " + ", ".join(conflicts) + ")",
            param=conflicts[0],
        )
    try:
        return BeamSearchParams(
            beam_width=beam_width,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature if req.temperature is not None else 0.0,
            length_penalty=req.length_penalty,
            early_stopping=req.early_stopping,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except InvalidRequestError as exc:
        param = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=param) from None


async def beam_search_output(
    engine: Any,
    request_id: str,
    prompt_ids: list[int],
    params: BeamSearchParams,
    n: int,
    priority: int = 0,
) -> RequestOutput:
    """The best ``n`` beams of one prompt as a finished output."""
    result = await beam_search_async(
        engine, prompt_ids, params, request_id=request_id, priority=priority
    )
    return as_request_output(request_id, prompt_ids, result, n)


async def single(output: Any) -> AsyncIterator[RequestOutput]:
    """A beam search's result as a one-item stream (the routes' streaming code takes
    streams; a beam search's text is known only at its end)."""
    yield await output
