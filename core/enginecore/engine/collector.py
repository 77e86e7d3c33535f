"""``RequestOutputCollector``: the one-slot mailbox between AsyncLLM's output task and a caller.

The output task never waits for a consumer: it ``put``s each new RequestOutput into the
request's collector and moves on. When the consumer has not taken the previous output yet,
the new one is *merged* into it, so a slow consumer receives fewer, larger chunks — but
exactly the same tokens and text, none lost and none repeated.
"""

from __future__ import annotations

import asyncio

from enginecore.engine.output import CompletionOutput, OutputKind, RequestOutput


class RequestOutputCollector:
    """Holds at most one pending item: a RequestOutput (possibly merged) or an exception."""

    def __init__(self, request_id: str, output_kind: OutputKind = OutputKind.DELTA) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.finished = False  # the last output (or an error) has been put
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Never blocks. An exception replaces whatever is pending (it ends the request)."""
        if isinstance(item, BaseException):
            self._item = item
            self.finished = True
        elif self._item is None:
            self._item = item
        elif isinstance(self._item, RequestOutput):
            _merge(self._item, item, self.output_kind)
        # else: an error is pending; later outputs of a failed request are dropped.
        if isinstance(item, RequestOutput) and item.finished:
            self.finished = True
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The pending output (waiting for one); raises a pending exception."""
        while self._item is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self._item is None else self._take()

    def _take(self) -> RequestOutput:
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None  # called only when an item is ready
        return item


def _merge(pending: RequestOutput, new: RequestOutput, kind: OutputKind) -> None:
    """Fold ``new`` into ``pending`` in place (completions matched by their index)."""
    by_index = {c.index: c for c in pending.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            pending.outputs.append(completion)
            by_index[completion.index] = completion
        elif kind is OutputKind.DELTA:
            _append(old, completion)
        else:  # CUMULATIVE (and FINAL_ONLY): the newer one holds everything
            pending.outputs[pending.outputs.index(old)] = completion
            by_index[completion.index] = completion
    pending.outputs.sort(key=lambda c: c.index)
    pending.finished = new.finished
    pending.metrics = new.metrics
    pending.num_cached_tokens = new.num_cached_tokens
    if pending.prompt_logprobs is None:  # streaming sends them once: keep them
        pending.prompt_logprobs = new.prompt_logprobs


def _append(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = old.token_ids + new.token_ids
    if new.logprobs is not None:
        old.logprobs = (old.logprobs or []) + new.logprobs
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
