"""``stream_options.min_characters`` (vLLM): streamed text held back until enough of it
is pending, so a client gets fewer, larger chunks; each choice's last chunk sends what is
left."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from enginecore.engine.output import CompletionOutput, RequestOutput
from enginecore.server.protocol import SamplingFields


def buffered(
    body: SamplingFields, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """The stream, regrouped by ``stream_options.min_characters`` when the request sets it."""
    options = body.stream_options
    if options is None or not options.min_characters:
        return outputs
    return at_least_characters(outputs, options.min_characters)


def _joined(pending: CompletionOutput | None, new: CompletionOutput) -> CompletionOutput:
    if pending is None:
        return dataclasses.replace(new, token_ids=list(new.token_ids))
    logprobs = pending.logprobs
    if new.logprobs is not None:
        logprobs = (logprobs or []) + new.logprobs
    return dataclasses.replace(
        new,
        text=pending.text + new.text,
        token_ids=pending.token_ids + new.token_ids,
        logprobs=logprobs,
    )


async def at_least_characters(
    outputs: AsyncIterator[RequestOutput], min_characters: int
) -> AsyncIterator[RequestOutput]:
    """Delta outputs regrouped so that each choice's text comes in pieces of at least
    ``min_characters`` characters (its final piece excepted)."""
    pending: dict[int, CompletionOutput] = {}
    last: RequestOutput | None = None
    async for output in outputs:
        last = output
        ready = []
        for completion in output.outputs:
            joined = _joined(pending.pop(completion.index, None), completion)
            if len(joined.text) >= min_characters or joined.finished:
                ready.append(joined)
            else:
                pending[completion.index] = joined
        if ready or output.finished:
            yield dataclasses.replace(output, outputs=ready)
    if pending and last is not None:  # the stream ended without finishing them (an abort)
        yield dataclasses.replace(last, outputs=list(pending.values()))
