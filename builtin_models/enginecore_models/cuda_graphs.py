"""Decode steps replayed from CUDA graphs captured at start-up.

A decode step launches hundreds of small kernels whose launch cost, at small batches,
exceeds their run time. Each bucket size (1, 2, 4, 8, then multiples of 16 up to
``max_num_seqs``) gets one graph of the model's forward over that many decode tokens,
captured once. A decode-only step of ``n`` requests pads itself to the smallest bucket
that holds it (padding rows write nothing: slot -1) and replays that graph after
refilling the static inputs in place: token ids, positions and the attention backend's
metadata, which a graph-capable backend keeps in persistent buffers.

Graphs are used only with a backend that declares ``cuda_graphs``, one rank (no
collectives inside a graph) and no KV connector; ``enforce_eager`` turns them off. With
LoRA each bucket gets a second graph whose projections add the adapters' delta through
``enginecore.lora.graph_inputs`` (dense kernels over a persistent per-row slot buffer);
a step with an adapter token replays that one, a step without replays the plain one. A
module that cannot be captured says why through ``cuda_graph_blocker()`` (an MoE layer
whose experts group tokens on the host, ``layers/moe.py``): then the model runs eager and
the reason is logged.
Their memory is measured by a capture over a one-block cache while the KV cache is
sized, and counted there.

Which steps replay a graph and why the others run eager (``step_graph_plan``; each
replica counts them in ``DecodeGraphs.counts``, which ``benchmarks/gpu_check.py``
reports):

- a decode-only step of at most ``max_num_seqs`` rows: the graph of the next bucket;
- a step with a row of several query tokens (a prefill, a chunk of one, or a speculative
  verification): its attention shapes vary step to step, so with
  ``model.piecewise_cuda_graphs`` it replays the pieces between its attention ops, padded
  to a token count (``piecewise_graphs.py``), attention eager; otherwise, and past the
  largest padded count, eager;
- whole runners run eager with several KV cache groups (a graph replays one block
  table), TP/PP > 1 (collectives are not captured), a KV connector (its per-layer hooks
  run on the host) or a module that says it cannot be captured (``graphs_apply``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any

import numpy as np
import torch

from enginecore.layers.attention import AttentionBatch, AttentionContext
from enginecore.layers.rotary import RotaryEmbedding
from enginecore.lora.graph_inputs import LoRAGraphInputs
from enginecore_models.piecewise_graphs import CudaGraphSeam, PiecewiseGraphs

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


REPLAYED = "replayed"
MULTI_TOKEN_ROWS = "eager: a row with several query tokens (prefill, chunk or verification)"
TOO_MANY_ROWS = "eager: more rows than the largest captured batch"


def step_graph_plan(batch: AttentionBatch, sizes: list[int]) -> tuple[int | None, str]:
    """``(captured batch size, REPLAYED)`` for a step a graph replays, else ``(None, why
    it runs eager)``. ``sizes`` are the captured batch sizes, ascending."""
    n = len(batch.query_lens)
    if batch.num_decodes != n:
        return None, MULTI_TOKEN_ROWS
    if not 0 < n <= sizes[-1]:
        return None, TOO_MANY_ROWS
    return next(s for s in sizes if s >= n), REPLAYED


def capture_blockers(model: torch.nn.Module) -> list[str]:
    """Why modules of ``model`` cannot be captured (``cuda_graph_blocker()``), each once."""
    reasons: list[str] = []
    for module in model.modules():
        blocker = getattr(module, "cuda_graph_blocker", None)
        reason = blocker() if callable(blocker) else None
        if reason and reason not in reasons:
            reasons.append(reason)
    return reasons


def graphs_apply(runner: Any) -> bool:
    """Whether this runner's steps may be captured (a module that cannot be is logged)."""
    if runner.device.type == "cuda" and not runner.config.model.enforce_eager:
        blockers = capture_blockers(runner.model)
        if blockers:
            # Asked at sizing and again at capture: said once per model.
            if not getattr(runner.model, "_graph_blockers_logged", False):
                logger.warning("CUDA graphs are off, the model runs eager: %s", "; ".join(blockers))
                runner.model._graph_blockers_logged = True
            return False
    return (
        runner.device.type == "cuda"
        and not runner.config.model.enforce_eager
        and runner.attn_backend.capabilities.cuda_graphs
        and runner.parallel.world_size == 1
        and not runner.worker_spec.kv_connector_ref
        # Graphs replay one block table; KV cache groups have one per group.
        and len(runner.kv_cache_group_windows) == 1
    )


def piecewise_graphs_apply(runner: Any) -> bool:
    """Whether multi-token steps are captured in pieces too (``piecewise_graphs.py``):
    asked for (``model.piecewise_cuda_graphs``), and without LoRA, whose per-step
    adapter mapping the pieces do not take as an input (said once)."""
    if not runner.config.model.piecewise_cuda_graphs or not graphs_apply(runner):
        return False
    if getattr(runner, "lora", None) is not None:
        if not getattr(runner, "_piecewise_lora_logged", False):
            logger.warning("piecewise CUDA graphs are off with LoRA: multi-token steps run eager")
            runner._piecewise_lora_logged = True
        return False
    return True


class DecodeGraphs:
    def __init__(self, runner: Any, kv_caches: list[torch.Tensor]) -> None:
        self.runner = runner
        self.kv_caches = kv_caches
        self.sizes = bucket_sizes(runner.config.scheduler.max_num_seqs)
        top = self.sizes[-1]
        dev = runner.device
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        # (rows, with LoRA) -> graph and its output
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        lora = getattr(runner, "lora", None)
        self.lora = LoRAGraphInputs(lora.state, top, dev) if lora is not None else None
        self.pool = torch.cuda.graph_pool_handle()
        self.counts: Counter[str] = Counter()  # steps replayed, and eager by reason

    def _padded(self, batch: AttentionBatch | None, size: int) -> AttentionBatch:
        """``batch`` padded with rows that write nothing (slot -1) and read block 0; with
        no batch (capture), rows whose first one spans ``max_model_len`` positions, so the
        kernels are set up for the longest context a replay may bring."""
        n = 0 if batch is None else len(batch.query_lens)
        width = 1 if batch is None else batch.block_table.shape[1]
        if batch is None:
            width = -(-self.runner.get_max_model_len() // self.runner.block_size)
        table = np.zeros((size, width), dtype=np.int64)
        ctx = np.zeros(size, dtype=np.int64)
        slots = np.full(size, -1, dtype=np.int64)
        if batch is not None:
            table[:n] = batch.block_table
            ctx[:n] = batch.context_lens
            slots[:n] = batch.slot_mapping
        else:
            ctx[0] = self.runner.get_max_model_len() - 1
        ids = [f"pad{i}" for i in range(size)]
        if batch is not None:
            ids[:n] = batch.req_ids
        return AttentionBatch(ids, np.ones(size, dtype=np.int64), ctx, table, slots, size)

    def capture(self) -> None:
        runner, backend = self.runner, self.runner.attn_backend
        torch.cuda.synchronize(runner.device)
        variants = (False, True) if self.lora is not None else (False,)
        for size in reversed(self.sizes):  # largest first: smaller ones reuse its pool
            ctx = AttentionContext(backend, backend.build_metadata(self._padded(None, size)))
            ids, pos = self.ids[:size], self.positions[:size]
            for with_lora in variants:
                with self._lora_capture(size, with_lora):
                    for _ in range(2):  # warm up (autotuning, lazy allocations) outside
                        runner._forward(ids, pos, self.kv_caches, ctx)
                    torch.cuda.synchronize(runner.device)
                    # Per-step caches keyed on the (static) positions tensor were filled
                    # by the warm-up, outside the graph: drop them so the graph computes
                    # its own.
                    for module in runner.model.modules():
                        if isinstance(module, RotaryEmbedding):
                            module.forget_step()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        out = runner._forward(ids, pos, self.kv_caches, ctx)
                self.graphs[(size, with_lora)] = (graph, out)
        torch.cuda.synchronize(runner.device)

    def _lora_capture(self, size: int, with_lora: bool) -> contextlib.AbstractContextManager[None]:
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.capturing(size, with_lora)

    def handles(self, batch: AttentionBatch) -> bool:
        size, outcome = step_graph_plan(batch, self.sizes)
        self.counts[outcome] += 1
        return size is not None

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        n = len(batch.query_lens)
        size, _ = step_graph_plan(batch, self.sizes)
        assert size is not None, "run() follows handles()"
        self.runner.attn_backend.build_metadata(self._padded(batch, size))  # in place
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if size > n:
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
        with_lora = self.lora is not None and self.lora.fill(size)
        graph, out = self.graphs[(size, with_lora)]
        graph.replay()
        return out[:n]


def measure_graph_memory(runner: Any) -> int:
    """Bytes the graphs' pool takes: captured over a one-block cache, then dropped."""
    before = torch.cuda.memory_reserved(runner.device)
    caches = runner.attn_backend.allocate_kv_cache(1)
    graphs = DecodeGraphs(runner, caches)
    graphs.capture()
    pieces = None
    if piecewise_graphs_apply(runner):
        pieces = PiecewiseGraphs(runner, caches, CudaGraphSeam(runner.device))
        pieces.capture()
    used = torch.cuda.memory_reserved(runner.device) - before
    del graphs, pieces, caches
    torch.cuda.empty_cache()
    logger.info(
        "CUDA graphs for %d batch sizes take %.1f MiB",
        len(bucket_sizes(runner.config.scheduler.max_num_seqs)),
        used / 2**20,
    )
    return max(used, 0)
