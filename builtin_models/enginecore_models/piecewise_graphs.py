"""Piecewise CUDA graphs: steps with multi-token rows (prefills, chunks, verification)
captured between their attention ops, attention itself run eager.

A decode-only step has one shape per batch size and replays a whole-model graph
(``cuda_graphs.py``). A step with a prefill or a verification row has attention shapes
that change every step (query lengths, context lengths), but everything else in the
forward (embedding, norms, projections, rotary, MLP) is row-wise: it depends only on the
step's token count. As vLLM splits its compiled model at the attention ops, the forward
here is cut at every ``Attention`` call into ``layers + 1`` pieces; each piece is
captured once per padded token count (:func:`token_sizes`), and a step replays piece
``i``, runs attention ``i`` eager over its real tokens with the step's metadata, replays
piece ``i + 1``, and so on.

The cut needs no change to the model: the forward runs with an attention backend proxy
(:class:`_SplitBackend`) whose ``forward`` is the boundary. What a capture records is the
pieces' graphs and, per attention call, the layer and the tensors it read (memory of the
graph pool that the replays rewrite in place); attention writes its output into a
persistent buffer (one per shape, shared by the layers) that the next piece reads (rows
past the real tokens are zero).
Padding rows embed token 0 at position 0: being row-wise, they never touch real rows,
and their attention is skipped, so they write no KV.

The CUDA calls stay in :class:`CudaGraphSeam`; :class:`EagerSeam` runs the same split,
the same static buffers and the same padding without capturing, so the split is checked
on a CPU token for token (``tests/gpu_path/test_piecewise_graphs.py``).

Not captured, each for a reason logged once per runner (``PiecewiseGraphs.counts``):
more tokens than the largest size (the GEMMs are compute-bound there, launch overhead a
small share) and everything ``graphs_apply`` refuses (several KV cache groups, TP/PP,
a KV connector, a module that cannot be captured). LoRA runs eager: its per-step adapter
mapping is not among the captured pieces' inputs.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from enginecore.layers.attention import AttentionBatch, AttentionContext
from enginecore.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

PIECEWISE = "piecewise: pieces replayed, attention eager"
TOO_MANY_TOKENS = "eager: more tokens than the largest piecewise graph"
_LARGEST = 512  # past this many tokens a step's GEMMs are compute-bound


def token_sizes(max_num_batched_tokens: int) -> list[int]:
    """The padded token counts captured: 8, 16, 32, then multiples of 32 to 256, then
    multiples of 64 up to ``min(max_num_batched_tokens, 512)`` (that one included)."""
    top = max(1, min(max_num_batched_tokens, _LARGEST))
    sizes = [n for n in (8, 16) if n < top]
    sizes += [n for n in range(32, 257, 32) if n < top]
    sizes += [n for n in range(320, _LARGEST + 1, 64) if n < top]
    return [*sizes, top]


def piecewise_plan(num_tokens: int, sizes: list[int]) -> tuple[int | None, str]:
    """``(padded token count, PIECEWISE)`` for a step the pieces replay, else ``(None,
    why it runs eager)``. ``sizes`` ascending."""
    if not 0 < num_tokens <= sizes[-1]:
        return None, TOO_MANY_TOKENS
    return next(s for s in sizes if s >= num_tokens), PIECEWISE


class GraphSeam(Protocol):
    """Captures a run of device work and replays it (the only CUDA calls here)."""

    replays: bool  # False: nothing is captured, each step runs the split forward

    def capturing(self) -> contextlib.AbstractContextManager[None]: ...

    def begin(self) -> None: ...

    def end(self) -> Callable[[], None]: ...


class CudaGraphSeam:
    """``torch.cuda.CUDAGraph`` pieces in one memory pool, captured on a side stream."""

    replays = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._graph: torch.cuda.CUDAGraph | None = None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> Callable[[], None]:
        graph = self._graph
        assert graph is not None, "end() follows begin()"
        graph.capture_end()
        self._graph = None
        return graph.replay


class EagerSeam:
    """Captures nothing: the split forward runs as it is (a CPU, and the tests)."""

    replays = False

    def capturing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def begin(self) -> None:
        pass

    def end(self) -> Callable[[], None]:
        return _nothing


def _nothing() -> None:
    pass


@dataclass
class _AttentionCall:
    """One attention op of a captured forward: the layer and the tensors it read."""

    layer: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor | None
    out: torch.Tensor  # where its output goes (the next piece reads it)


@dataclass
class _Captured:
    pieces: list[Callable[[], None]]  # len(calls) + 1
    calls: list[_AttentionCall]
    hidden: torch.Tensor  # the last piece's output, [size, hidden]


class _SplitBackend:
    """The runner's attention backend with ``forward`` as the cut between pieces."""

    def __init__(self, backend: Any, split: PiecewiseGraphs) -> None:
        self._backend, self._split = backend, split

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: Any,
    ) -> torch.Tensor:
        return self._split.cut(layer, query, key, value, kv_cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class PiecewiseGraphs:
    """Multi-token steps: pieces between attention ops, one set per padded token count."""

    def __init__(self, runner: Any, kv_caches: list[torch.Tensor], seam: GraphSeam) -> None:
        self.runner, self.kv_caches, self.seam = runner, kv_caches, seam
        self.backend = runner.attn_backend
        self.sizes = token_sizes(runner._max_num_batched_tokens())
        top, dev = self.sizes[-1], runner.device
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        # Attention's output, one buffer per shape shared by every layer of that shape
        # (the piece after an attention op reads it before the next op writes it).
        self.outs: dict[tuple[int, ...], torch.Tensor] = {}
        self.captured: dict[int, _Captured] = {}
        self.counts: Counter[str] = Counter()  # steps by outcome (gpu_check.py prints it)
        # Set around one forward through the split.
        self._calls: list[_AttentionCall] | None = None
        self._pieces: list[Callable[[], None]] | None = None
        self._live: tuple[Any, int] | None = None  # (metadata, real tokens), None: capture

    # --- the cut --------------------------------------------------------------------

    def _out(self, query: torch.Tensor) -> torch.Tensor:
        shape = tuple(query.shape[1:])
        out = self.outs.get(shape)
        if out is None or out.dtype != query.dtype:
            top = self.sizes[-1]
            out = torch.zeros((top, *shape), dtype=query.dtype, device=query.device)
            self.outs[shape] = out
        return out[: query.shape[0]]

    def cut(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        capturing = self._pieces is not None
        if capturing:
            assert self._pieces is not None
            self._pieces.append(self.seam.end())
        out = self._out(query)  # allocated outside any capture
        call = _AttentionCall(layer, query, key, value, kv_cache, out)
        if self._calls is not None:
            self._calls.append(call)
        if self._live is not None:
            self._attend(call, out, *self._live)
        if capturing:
            self.seam.begin()
        return out

    def _attend(self, call: _AttentionCall, out: torch.Tensor, metadata: Any, n: int) -> None:
        """Attention over the real tokens, eager; padding rows stay zero."""
        result = self.backend.forward(
            call.layer, call.query[:n], call.key[:n], call.value[:n], call.kv_cache, metadata
        )
        out[:n].copy_(result)
        if out.shape[0] > n:
            out[n:].zero_()

    # --- capture and replay ---------------------------------------------------------

    def _forward(self, size: int) -> torch.Tensor:
        ctx = AttentionContext(_SplitBackend(self.backend, self), None)
        hidden: torch.Tensor = self.runner._forward(
            self.ids[:size], self.positions[:size], self.kv_caches, ctx
        )
        return hidden

    def capture(self) -> None:
        """One set of pieces per size, largest first (smaller ones reuse its pool).
        Attention is not run while capturing: no KV is written."""
        with self.seam.capturing():
            for size in reversed(self.sizes):
                self._live = None
                for _ in range(2):  # warm up (autotuning, lazy allocations) outside
                    self._forward(size)
                for module in self.runner.model.modules():
                    if isinstance(module, RotaryEmbedding):
                        module.forget_step()  # filled by the warm-up, outside the graph
                self._calls, self._pieces = [], []
                try:
                    self.seam.begin()
                    hidden = self._forward(size)
                    self._pieces.append(self.seam.end())
                    self.captured[size] = _Captured(self._pieces, self._calls, hidden)
                finally:
                    self._calls, self._pieces = None, None
        logger.info("piecewise CUDA graphs captured for %d token counts", len(self.sizes))

    def handles(self, batch: AttentionBatch) -> bool:
        size, outcome = piecewise_plan(int(batch.slot_mapping.shape[0]), self.sizes)
        self.counts[outcome] += 1
        if size is None and self.counts[outcome] == 1:
            logger.info("%s (%d)", outcome, self.sizes[-1])
        return size is not None

    def _fill(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[int, int]:
        n = ids.shape[0]
        size, _ = piecewise_plan(n, self.sizes)
        assert size is not None, "run() follows handles()"
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if size > n:
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
        return n, size

    def run(self, ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Replay the pieces of the step's padded size, attention eager between them
        (with a seam that captures nothing, :meth:`run_eager`)."""
        if not self.seam.replays:
            return self.run_eager(ids, positions, metadata)
        n, size = self._fill(ids, positions)
        captured = self.captured[size]
        for piece, call in zip(captured.pieces, captured.calls, strict=False):
            piece()
            self._attend(call, call.out, metadata, n)
        captured.pieces[-1]()
        return captured.hidden[:n]

    def run_eager(self, ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        """The same split, buffers and padding, nothing captured (a CPU, the tests)."""
        n, size = self._fill(ids, positions)
        self._live = (metadata, n)
        try:
            return self._forward(size)[:n]
        finally:
            self._live = None
