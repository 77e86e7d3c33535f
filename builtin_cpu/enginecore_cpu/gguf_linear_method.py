"""The ``gguf`` linear method: quantized projections kept quantized on CPU and multiplied
by ``quant_kernels`` / ``kquant_kernels``.

A decode step reads every weight once, so its time is the weights' bytes over memory
bandwidth: a Q4_1 weight is 5 bits a value against float32's 32. The weight loader hands
tensors in the formats this method names (``gguf_formats``) over as
:class:`enginecore.layers.quantized.QuantizedTensor`: GGUF's Q8_0, Q4_0, Q4_1 (32-value
blocks), Q4_K, Q5_K and Q6_K (at the file's bits a value, its scales per super-block of
256), and the 4-bit groups of AWQ / GPTQ checkpoints (as 4-bit blocks of 32). Other formats
(F16, other GGUF types) arrive de-quantized and take the ``cpu_packed`` path, as does a
layer whose shards came in mixed forms. With ``model.quantization: int8`` a float
projection is quantized here to int8 per output channel. The LM head (often tied to the
embedding, which the lookup needs in float) computes the logits from the file's own
blocks where they came in a format above (the largest single read of a small model, at
the file's bits a value), else from a Q8_0 copy of its float table.

Activations are quantized to 8 bits per block of 32 as llama.cpp does (so the error is
llama.cpp's); docs/quantization.md states the accuracy against the de-quantized weights
and the kernels' timings.

Many rows (prefill) take ``quant_gemm``: the activations quantized once, each weight
block decoded once a call and used for every row, faster than a float32 GEMM on a
de-quantized copy at every row count measured, so no float copy is made and a model
stays at its file's size in memory. Few rows take the one-row kernels, which read each
block once per four rows and need no decoding.

Loading a GGUF file, each layer's blocks are prepared once and kept on disk
(``prepared_weights``); later loads map them and read no weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats import parts as block_parts
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.block_formats.parts import Part, dequantized_part, per_channel_q8, unpacked
from enginecore.config import EngineConfig
from enginecore.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from enginecore.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
    quantized_shard_rows,
)
from enginecore.layers.quantized import INT4_BLOCKS, QuantizedTensor
from enginecore.layers.weights import set_weight_attrs
from enginecore_cpu import cpu_kernels, kernel_cache, kquant_kernels, quant_gemm, quant_kernels
from enginecore_cpu.linear_method import CpuPackedLinearMethod
from enginecore_cpu.prepared_weights import PreparedWeights

logger = logging.getLogger(__name__)

# Rows from which a product takes ``quant_gemm`` rather than the one-row kernels, per
# layout: where the two cross with the CPU's VNNI (benchmarks/RESULTS.md, "Other
# measurements behind the code"), and without it (AVX2's vpmaddubsw; RESULTS.md, "Decode
# batches: where the many-row kernel overtakes the one-row kernels", measured by
# ``benchmarks/quant_gemm_rows.py --level x86-64-v3``). Its fixed cost is decoding each
# block once a call; the one-row kernels' grows with the rows (a block unpacked per four
# rows). The fused decode step switches kernels at the same rows (``decode_step.py``).
GEMM_FROM_ROWS = {"Q4": 12, "Q8": 8, "Q4_K": 12, "Q5_K": 8, "Q6_K": 12}
GEMM_FROM_ROWS_NO_VNNI = {"Q4": 32, "Q8": 16, "Q4_K": 32, "Q5_K": 16, "Q6_K": 16}
# Without ``quant_gemm`` (its build failed): more rows than this take float32 GEMMs, one
# per tile of the weight's rows de-quantized for the call. The fused decode step takes
# batches up to this size.
DIRECT_MAX_ROWS = 32
# A tile's float32 bytes: de-quantized per call, it stays in cache, where a whole weight
# would be fresh memory (page faults) on every call.
_TILE_BYTES = 4 << 20
_BLOCKS = "gguf_blocks"  # layer attribute: [(first output row, BlockWeight)], row order
_PARTS = "_gguf_parts"  # while loading: {first output row: the checkpoint's rows}


class GGUFLinearMethod(CpuPackedLinearMethod):
    name = "gguf"
    # Chosen through model.quantization (GGUF files, AWQ / GPTQ, int8), never by default.
    priority = 0
    devices = ("cpu",)
    gguf_formats = (*gguf_blocks.FORMATS, *kquant_blocks.FORMATS, INT4_BLOCKS)

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        self.prepared: PreparedWeights | None = None
        model_path = getattr(getattr(config, "model", None), "path", None)
        path = Path(model_path) if model_path else None
        if path is not None and path.suffix == ".gguf" and PreparedWeights.enabled():
            try:
                self.prepared = PreparedWeights(path)
            except OSError:
                self.prepared = None  # no such file: the loader names the problem

    @classmethod
    def unsupported_reason(cls, device: str, dtype: str) -> str | None:
        reason = super().unsupported_reason(device, dtype)
        if reason is None and dtype != "float32":
            return f"computes in float32 only, not {dtype}"
        return reason

    def kernel_builds(self) -> list[Callable[[], Path]]:
        from enginecore_cpu import decode_step  # it imports this module

        builds = super().kernel_builds()
        if not cpu_kernels.switched_off(quant_kernels.ENV_SWITCH):
            # In the order they are needed (compilers queue for a few slots): the blocks'
            # kernels as the weights are processed, the first forward's, prefill's, decode's.
            builds[:0] = [quant_kernels.build, kquant_kernels.build]
            builds.append(quant_gemm.build)
            # The fused step's library comes last, an idle build: nothing waits for it (the
            # layers serve until it lands), and it yields the CPU to the load and the first
            # requests.
            if not cpu_kernels.switched_off(decode_step.ENV_SWITCH):
                builds.append(kernel_cache.idle(decode_step.build))
        return builds

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        if not isinstance(layer, LinearBase):
            raise TypeError(f"{self.name} makes the weights of linear layers, not {layer!r}")
        super().create_weights(layer, input_size, output_size, dtype)
        float_loader = layer.weight_loader  # the loader the parent class gave the weight

        def weight_loader(param: torch.Tensor, loaded: Any, shard: Any = None) -> None:
            if isinstance(loaded, QuantizedTensor):
                self._load_blocks(layer, param, loaded, shard, float_loader)
            elif shard is None:
                float_loader(param, loaded)
            else:
                float_loader(param, loaded, shard)

        set_weight_attrs(layer.weight, {"weight_loader": weight_loader})

    def _load_blocks(
        self,
        layer: LinearBase,
        param: torch.Tensor,
        loaded: QuantizedTensor,
        shard: Any,
        float_loader: Callable[..., None],
    ) -> None:
        if isinstance(layer, RowParallelLinear) and layer.parallel.tp_size > 1:
            # A split of the input dimension cuts through blocks' rows: keep it in float.
            float_loader(param, _dequantized(loaded))
            return
        pieces = layer.__dict__.setdefault(_PARTS, {})
        for first, piece in quantized_shard_rows(layer, loaded, shard):
            pieces[first] = piece

    def _prepared_key(self, pieces: dict[int, QuantizedTensor]) -> str | None:
        """What the prepared-weight cache knows the layer by: its rows' sources."""
        if self.prepared is None or not pieces or not all(p.source for p in pieces.values()):
            return None
        return "|".join(
            f"{first}:{p.source}:{p.format}:{p.shape[0]}x{p.shape[1]}"
            for first, p in sorted(pieces.items())
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pieces: dict[int, QuantizedTensor] = layer.__dict__.pop(_PARTS, {})
        key = self._prepared_key(pieces)
        cached = self.prepared.load(key) if self.prepared is not None and key else None
        if cached is None and self.prepared is not None and key:
            cached = _unpacked_in_place(self.prepared, key, pieces)
        parts: dict[int, Part]
        if cached is not None:
            parts = dict(cached)
        else:
            parts = dict(_unpacked_runs(pieces))
        kernels = _kernels_for(parts, prepared=cached is not None)
        weight = cast(torch.Tensor, layer.weight)
        covered = sum(p.shape[0] for p in parts.values())
        # a token embedding's float table stays for the lookups
        table = isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
        if parts and (not kernels or covered != weight.shape[0]):
            # No kernels, or some shards came in float: the layer computes in float (a
            # table holds its values already).
            for first, part in parts.items():
                if not table:
                    weight.data[first : first + part.shape[0]] = dequantized_part(part)
            parts = {}
        if not parts and self._int8_wanted(layer, kernels):
            parts = {0: per_channel_q8(weight.data)}
        if parts:
            merged = cached if cached is not None else _merged(parts)
            if key is not None and cached is None:
                assert self.prepared is not None
                self.prepared.save(key, merged)
                # Mapped back where it was written, as a warm load does: the copy made
                # here is freed, and only the pages the kernels read are resident.
                merged = self.prepared.load(key) or merged
            setattr(layer, _BLOCKS, merged)
            if not table:
                weight.data = torch.empty(0)  # never filled: the blocks replace it
            return
        if (
            isinstance(layer, VocabParallelEmbedding)
            and kernels
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.shape[1] % gguf_blocks.BLOCK == 0
        ):
            # One such head a model: the file's key and its shape name it in the cache.
            head_key = f"Q8_0 copy of the {type(layer).__name__} {tuple(weight.shape)}"
            blocks = self.prepared.load(head_key) if self.prepared is not None else None
            if blocks is None:
                blocks = [(0, gguf_blocks.quantize_q8(weight))]
                if self.prepared is not None:
                    self.prepared.save(head_key, blocks)
            setattr(layer, _BLOCKS, blocks)
            # The logits come from the blocks: the table stays as the lookup reads it
            # (packing or transposing it would copy a table no product reads).
            return
        super().process_weights_after_loading(layer)

    def embedding_table(self, layer: nn.Module, blocks: QuantizedTensor) -> torch.Tensor | None:
        """A GGUF file's token embedding as float32, kept in the prepared-weight cache:
        later loads map it, and only the rows looked up are ever read (the de-quantizing
        and copying of the whole table held up every load)."""
        # The logits are computed from these blocks, as a projection's (prepared and
        # cached with the layers'), not from a copy of the float table.
        layer.__dict__.setdefault(_PARTS, {})[0] = blocks
        weight = cast(torch.Tensor, layer.weight)
        if isinstance(layer, ParallelLMHead):
            # An output head is never looked up: its float weight is filled only where its
            # blocks cannot be multiplied (process_weights_after_loading), and its pages
            # are never touched otherwise.
            return torch.empty(weight.shape, dtype=weight.dtype)
        if self.prepared is None or not blocks.source or weight.dtype != torch.float32:
            return None
        out, k = blocks.shape
        key = f"float32 table of {blocks.source} ({blocks.format}, {out}x{k})"
        table = self.prepared.load_table(key)
        if table is None:
            table = _table_in_place(self.prepared, key, blocks)
        if table is None:
            table = _dequantized_table(blocks)
            self.prepared.save_table(key, table)
            # Mapped back where it was written: resident only where looked up.
            mapped = self.prepared.load_table(key)
            table = table if mapped is None else mapped
        return table

    def _int8_wanted(self, layer: nn.Module, kernels: bool) -> bool:
        """``model.quantization: int8``: a float projection becomes int8 per channel."""
        return (
            self.config is not None
            and self.config.model.quantization == "int8"
            and kernels
            and isinstance(layer, ColumnParallelLinear | RowParallelLinear)
            and layer.weight.dtype == torch.float32
            and layer.weight.dim() == 2
            and layer.weight.shape[1] % gguf_blocks.BLOCK == 0
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        blocks = getattr(layer, _BLOCKS, None)
        if blocks is None and _PARTS in layer.__dict__:
            # A head whose model never had it prepared: its float weight was never filled.
            self.process_weights_after_loading(layer)
            blocks = getattr(layer, _BLOCKS, None)
        if blocks is None:
            return super().apply(layer, x, bias)
        return blocks_linear(blocks, x, bias)

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if getattr(layer, _BLOCKS, None) is not None:
            return None
        return super().apply_silu_and_mul(layer, x, bias)


def _kernels_for(parts: dict[int, Part], prepared: bool) -> bool:
    """Whether the blocks' kernels multiply ``parts``. Blocks read from the prepared
    weights do not wait at load for a library still compiling: the first product waits
    for it (``blocks_linear``), so that a start does no more than a warm start; blocks
    prepared now need the kernels loaded."""
    kquant = any(_needs_kquant(p) for p in parts.values())
    if prepared:
        return quant_kernels.library.possible() and (
            not kquant or kquant_kernels.library.possible()
        )
    return quant_kernels.load() is not None and (not kquant or kquant_kernels.load() is not None)


def _needs_kquant(part: Part) -> TypeGuard[KQuantWeight]:
    """Whether ``kquant_kernels`` multiplies ``part`` (Q5_K, Q6_K; Q4_K is ``quant_kernels``')."""
    return isinstance(part, KQuantWeight) and part.fmt != "Q4_K"


def _dequantize_with(
    kernels: quant_kernels.QuantKernels, part: Part, out: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(part, BlockWeight):
        values: torch.Tensor = kernels.dequantize(part.bits, part.qs, part.d, part.m, out)
        return values
    if part.fmt == "Q4_K":
        values = kernels.dequantize_q4_k(part, out)
        return values
    return _kquant().dequantize_k(part, out)


def _dequantized_table(blocks: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values of a file's table (a token embedding's): by the kernels' C
    de-quantization, on every thread, where they loaded (the same floats as torch's:
    they are built without contracting a multiply and an add), else in torch; written
    into ``out`` where given."""
    kernels, kquant = quant_kernels.load(), kquant_kernels.load()
    if kernels is None or (blocks.format in kquant_blocks.FORMATS and kquant is None):
        values = block_parts.dequantized_part(block_parts.unpacked(blocks))
        return values if out is None else out.copy_(values)
    if kquant is not None and blocks.format in kquant_blocks.FORMATS:
        return _dequantize_with(kernels, kquant.unpacked([blocks]), out)
    part: Part | None = None
    if kquant is not None and blocks.format in gguf_blocks.FORMATS:
        # The 32-value blocks by the same C pass as a layer's (torch's unpacking copied
        # the table's scales and values apart, several passes over a table's blocks).
        part = gguf_blocks.empty_blocks(blocks.format, blocks.shape)
        if not kquant.blocks_into([blocks], part):
            part = None  # a Q4_0 offset beyond float16: float32 scales from torch's pass
    return _dequantize_with(kernels, part if part is not None else unpacked(blocks), out)


def _kquant() -> kquant_kernels.KQuantKernels:
    """The 5- and 6-bit kernels: a layer keeps such blocks only where they loaded."""
    kernels = kquant_kernels.load()
    assert kernels is not None
    return kernels


def _row_range(part: Part, start: int, length: int) -> Part:
    """Output rows ``start`` to ``start + length`` of ``part`` (views, no copy)."""
    length = min(length, part.shape[0] - start)
    shape = (length, part.shape[1])
    if isinstance(part, KQuantWeight):
        qs, scales = part.qs[start : start + length], part.scales[start : start + length]
        return KQuantWeight(part.fmt, qs, scales, shape, part.high)
    qs, d, m = (t[start : start + length] for t in (part.qs, part.d, part.m))
    return BlockWeight(part.bits, qs, d, m, shape, part.symmetric)


def gemm_from_rows(part: Part, vnni: bool) -> int:
    """The rows from which ``part`` is multiplied by ``quant_gemm`` (``GEMM_FROM_ROWS``,
    or ``GEMM_FROM_ROWS_NO_VNNI`` for a library built without VNNI)."""
    table = GEMM_FROM_ROWS if vnni else GEMM_FROM_ROWS_NO_VNNI
    if isinstance(part, KQuantWeight):
        return table[part.fmt]
    return table["Q8" if part.bits == 8 else "Q4"]


def blocks_linear(
    blocks: list[tuple[int, Part]], x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` for W given as row ranges of blocks. The one-row kernels are
    waited for where they still compile: multiplying in torch meanwhile would
    de-quantize every weight at every step, slower than the build (benchmarks/RESULTS.md,
    "The first load: nothing waits for a compiler"); their build is the first queued."""
    kernels = quant_kernels.load()
    k = blocks[0][1].shape[1]
    n = sum(part.shape[0] for _, part in blocks)
    rows = x.reshape(-1, k)
    dtype = rows.dtype
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    count = rows.shape[0]
    gemm = quant_gemm.library.serving() if count >= min(GEMM_FROM_ROWS.values()) else None
    # While ``quant_gemm`` compiles, many rows take the one-row kernels: activations
    # quantized as the many-row kernel quantizes them, so the tokens do not change when
    # it lands (a float GEMM on de-quantized tiles computes on unquantized activations).
    compiling = gemm is None and quant_gemm.library.compiling is not None
    kquant = kquant_kernels.load() if any(_needs_kquant(p) for _, p in blocks) else None
    in_torch = kernels is None or (kquant is None and any(_needs_kquant(p) for _, p in blocks))
    if in_torch or (gemm is None and count > DIRECT_MAX_ROWS and not compiling):
        # Many rows without ``quant_gemm`` (its build failed), or a library whose build
        # failed after the blocks were kept (torch).
        tile = max(16, _TILE_BYTES // (4 * k))
        for first, part in blocks:
            for start in range(0, part.shape[0], tile):
                piece = _row_range(part, start, tile)
                weight = (
                    dequantized_part(piece) if in_torch or kernels is None
                    else _dequantize_with(kernels, piece)
                )  # fmt: skip
                out[:, first + start : first + start + weight.shape[0]] = F.linear(rows, weight)
        if bias is not None:
            out += bias
        return out.to(dtype).view(*x.shape[:-1], n)
    assert kernels is not None
    if count:
        acts = None  # quantized once for the kernels that take them so
        for first, part in blocks:
            target = out[:, first:] if first else out
            if gemm is not None and count >= gemm_from_rows(part, gemm.vnni):
                acts = kernels.quantize_rows(rows) if acts is None else acts
                gemm.gemm(acts, part, target)
            elif _needs_kquant(part):
                assert kquant is not None  # else in torch above
                acts = kernels.quantize_rows(rows) if acts is None else acts
                kquant.gemm_k(acts, part, target)
            else:
                kernels.linear(rows, part, target)
    if bias is not None:
        out += bias
    if dtype is not torch.float32:
        out = out.to(dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def _runs(
    pieces: dict[int, QuantizedTensor], joinable: Callable[[QuantizedTensor], bool]
) -> list[tuple[int, list[QuantizedTensor]]]:
    """``pieces`` in row order, adjacent ``joinable`` ones of one format and width
    grouped: (first row, the run's pieces)."""
    runs: list[tuple[int, list[QuantizedTensor]]] = []
    for first in sorted(pieces):
        piece = pieces[first]
        if runs and joinable(piece):
            start, run = runs[-1]
            last = run[-1]
            if (
                joinable(last)
                and (last.format, last.shape[1]) == (piece.format, piece.shape[1])
                and start + sum(p.shape[0] for p in run) == first
            ):
                run.append(piece)
                continue
        runs.append((first, [piece]))
    return runs


def _unpacked_runs(pieces: dict[int, QuantizedTensor]) -> list[tuple[int, Part]]:
    """The checkpoint's row ranges in the kernels' layouts, each run of adjacent K-quant
    ranges of one format unpacked into one weight by ``kquant_kernels`` (in C, on every
    thread, with no copy to join them); the rest by ``unpacked``, joined by ``_merged``."""
    kquant = None
    if any(p.format in kquant_blocks.FORMATS for p in pieces.values()):
        kquant = kquant_kernels.load()
    out: list[tuple[int, Part]] = []
    for first, run in _runs(pieces, lambda p: p.format in kquant_blocks.FORMATS):
        if kquant is not None and run[0].format in kquant_blocks.FORMATS:
            out.append((first, kquant.unpacked(run)))
        else:
            out.extend((first + sum(p.shape[0] for p in run[:i]), unpacked(piece))
                       for i, piece in enumerate(run))  # fmt: skip
    return out


def _unpacked_in_place(
    prepared: PreparedWeights, key: str, pieces: dict[int, QuantizedTensor]
) -> list[tuple[int, Part]] | None:
    """A layer of GGUF blocks unpacked straight into its new prepared-weight entry, in C
    on every thread (no copy in memory, no second write), then mapped back as a warm
    load maps it; None where a piece is of another kind (a group-wise 4-bit
    checkpoint's), a Q4_0 offset leaves float16's range, the kernels did not load or
    nothing can be written: the layer is prepared in memory then."""
    kquant = kquant_kernels.load()
    if kquant is None or not pieces:
        return None
    for p in pieces.values():
        kquant_fmt = p.format in kquant_blocks.FORMATS
        if not (kquant_fmt or p.format in gguf_blocks.FORMATS):
            return None
        if p.shape[1] % (kquant_blocks.SUPER if kquant_fmt else gguf_blocks.BLOCK):
            return None  # the in-memory pass names what is wrong
    runs = _runs(pieces, lambda p: True)
    plan: list[tuple[int, Part]] = []
    for first, run in runs:
        fmt, shape = run[0].format, (sum(p.shape[0] for p in run), run[0].shape[1])
        if fmt in kquant_blocks.FORMATS:
            plan.append((first, kquant_blocks.empty_weight(fmt, shape, "meta", kquant.high(fmt))))
        else:
            plan.append((first, gguf_blocks.empty_blocks(fmt, shape, "meta")))
    reserved = prepared.reserve(key, plan)
    if reserved is None or reserved.layer is None:
        return None
    try:
        for (_, run), (_, target) in zip(runs, reserved.layer, strict=True):
            if isinstance(target, KQuantWeight):
                kquant.unpacked(run, into=target)
            elif not kquant.blocks_into(run, target):
                reserved.abort()
                return None
    except BaseException:
        reserved.abort()
        raise
    return reserved.commit()


def _table_in_place(
    prepared: PreparedWeights, key: str, blocks: QuantizedTensor
) -> torch.Tensor | None:
    """A file's table (a token embedding's) de-quantized by the C kernels straight into
    its new prepared-weight entry, then mapped back as a warm load maps it: no float copy
    of the table in memory and no second write of it. None where the kernels did not load
    or nothing can be written: the table is made in memory then."""
    if quant_kernels.load() is None or kquant_kernels.load() is None:
        return None
    reserved = prepared.reserve(key, [(0, torch.empty(blocks.shape, device="meta"))])
    if reserved is None or reserved.table is None:
        return None
    try:
        _dequantized_table(blocks, out=reserved.table)
    except BaseException:
        reserved.abort()
        raise
    return reserved.commit_table()


def _merged(parts: dict[int, Part]) -> list[tuple[int, Part]]:
    """Adjacent row ranges of one layout joined, so the kernel runs once for them."""
    merged: list[tuple[int, Part]] = []
    for first in sorted(parts):
        part = parts[first]
        start, prev = merged[-1] if merged else (first, None)
        if (
            isinstance(part, KQuantWeight)
            and isinstance(prev, KQuantWeight)
            and (prev.fmt, prev.high) == (part.fmt, part.high)
        ):
            merged[-1] = (
                start,
                KQuantWeight(
                    part.fmt,
                    torch.cat([prev.qs, part.qs]),
                    torch.cat([prev.scales, part.scales]),
                    (prev.shape[0] + part.shape[0], part.shape[1]),
                    part.high,
                ),
            )
        elif (
            isinstance(part, BlockWeight)
            and isinstance(prev, BlockWeight)
            and prev.kind == part.kind
        ):
            rows = prev.shape[0] + part.shape[0]
            merged[-1] = (
                start,
                BlockWeight(
                    part.bits,
                    torch.cat([prev.qs, part.qs]),
                    torch.cat([prev.d, part.d]),
                    torch.cat([prev.m, part.m]),
                    (rows, part.shape[1]),
                    part.symmetric,
                ),
            )
        else:
            merged.append((first, part))
    return merged


def _dequantized(loaded: QuantizedTensor) -> torch.Tensor:
    return dequantized_part(unpacked(loaded))
