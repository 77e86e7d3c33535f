"""Building blocks shared by the model architectures, sharded for tensor parallelism.

Column-parallel layers split the output dimension across the TP ranks (no
communication); row-parallel layers split the input dimension and all-reduce their
partial outputs; the vocabulary-parallel embedding splits the vocabulary (each rank looks
up the ids it owns, zeros the rest, all-reduce) and the LM head computes this rank's
slice of the logits, then all-gathers them. Every parameter carries a ``weight_loader``
that copies this rank's shard out of the full checkpoint tensor, so checkpoints stay in
the ordinary unsharded HF layout. Collectives go through ``torch.distributed`` on the
group in the ``ParallelContext`` (gloo on CPU, NCCL on CUDA); at ``tp_size == 1`` every
layer is the plain dense one and nothing communicates.

KV heads are split across ranks when there are at least ``tp_size`` of them; with fewer
(``num_kv_heads < tp_size``), each KV head is replicated on ``tp_size / num_kv_heads``
ranks.

Parameters are created with ``torch.empty`` (no random init): every one is overwritten
by ``load_weights``, and skipping init makes building a model nearly free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.builtin_models import cpu_kernels, panel_gemm
from enginecore.builtin_models.packed_gemm import packed_for

# Re-exported: the rotary embedding and its scaling variants live in rotary.py.
from enginecore.builtin_models.rotary import RotaryEmbedding as RotaryEmbedding
from enginecore.builtin_models.rotary import rope_parameters as rope_parameters
from enginecore.distributed import ParallelContext


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"{what} ({total}) is not divisible by tensor_parallel_size ({parts}); "
            "choose a tensor_parallel_size that divides it"
        )
    return total // parts


def tp_all_reduce(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place (identity at tp_size 1)."""
    if parallel.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=parallel.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along the last dimension, in rank order."""
    if parallel.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x, group=parallel.tp_group)
    return torch.cat(parts, dim=-1)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b``. A weight stored wider than the activations (a half-precision model's
    projections in float32, see ``use_float32_projections``) computes in its dtype and
    rounds the result back once, as a half-precision GEMM with float32 accumulation does."""
    packed = packed_for(weight, x)  # a packed copy, where the runner made one
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias) if packed is None else packed.linear(x, bias)
    wide, bias = weight.dtype, None if bias is None else bias.to(weight.dtype)
    if packed is None:
        return F.linear(x.to(wide), weight, bias).to(x.dtype)
    return packed.linear(x.to(wide), bias).to(x.dtype)


def project_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x``'s [gate | up] projection in one pass, where the weight
    is packed in pairs for enginecore's GEMM (``panel_gemm``); None elsewhere, and the
    caller projects and then applies SiLU."""
    packed = packed_for(weight, x)
    if not isinstance(packed, panel_gemm.PanelWeight) or not packed.half:
        return None
    if x.dtype != weight.dtype:  # float32 projections of a half model round in between
        return None
    return packed.silu_and_mul(x, bias)


def _param(shape: Sequence[int], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W (and b) split along the output dim across TP ranks.

    The output is this rank's slice (the next layer is row-parallel and consumes it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features
        self.out_local = divide(out_features, parallel.tp_size, "output features")
        self.weight = _param((self.out_local, in_features), dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = _param((self.out_local,), dtype)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        rank = self.parallel.tp_rank
        default_weight_loader(param, loaded.narrow(0, rank * self.out_local, self.out_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """W split along the input dim; the partial outputs are all-reduced, then the (whole,
    unsplit) bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features
        self.in_local = divide(in_features, parallel.tp_size, "input features")
        self.weight = _param((out_features, self.in_local), dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = _param((out_features,), dtype)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        rank = self.parallel.tp_rank
        default_weight_loader(param, loaded.narrow(1, rank * self.in_local, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(project(x, self.weight), self.parallel)
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input fused into one matmul (e.g. gate and up).

    Each projection is split across ranks on its own, so a rank holds
    ``[gate_slice; up_slice]``. Checkpoints store them separately;
    ``weight_loader(param, tensor, shard_index)`` writes each into its rows, and
    ``shard=None`` takes one tensor holding all of them back to back (GPT-2's c_attn).
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        local_sizes: Sequence[int] | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        if local_sizes is None:
            local_sizes = [divide(n, parallel.tp_size, "output features") for n in output_sizes]
        self.local_sizes = list(local_sizes)
        nn.Module.__init__(self)
        self.parallel = parallel
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.out_local = sum(self.local_sizes)
        self.weight = _param((self.out_local, in_features), dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = None
        if bias:
            self.bias = _param((self.out_local,), dtype)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.output_offsets = [0, *list(_cumsum(self.local_sizes))]
        # load_params checks that every shard of a fused parameter was loaded.
        for p in (self.weight, self.bias):
            if p is not None:
                p.num_shards = len(output_sizes)  # type: ignore[attr-defined]

    def shard_start(self, shard: int) -> int:
        """Where this rank's rows of projection ``shard`` start in the full tensor."""
        return self.parallel.tp_rank * self.local_sizes[shard]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:
            for index, part in enumerate(torch.split(loaded, self.output_sizes, dim=0)):
                self.weight_loader(param, part, index)
            return
        start, end = self.output_offsets[shard], self.output_offsets[shard + 1]
        piece = loaded.narrow(0, self.shard_start(shard), end - start)
        default_weight_loader(param.data[start:end], piece)


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections fused; shards are addressed as "q", "k", "v".

    Query heads are split across ranks; KV heads too when there are at least
    ``tp_size`` of them, otherwise each rank holds the one KV head its query heads use.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        tp = parallel.tp_size
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = parallel.tp_rank * self.num_kv_heads
        else:
            divide(tp, num_kv_heads, "tensor_parallel_size / num_key_value_heads")
            self.num_kv_heads = 1  # replicated: tp / num_kv_heads ranks share one head
            self.kv_head_start = parallel.tp_rank * num_kv_heads // tp
        self.head_dim = head_dim
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        local = [self.num_heads * head_dim, *[self.num_kv_heads * head_dim] * 2]
        super().__init__(
            hidden_size, full, bias=bias, parallel=parallel, dtype=dtype, local_sizes=local
        )
        self.q_size, self.kv_size = local[0], local[1]

    def shard_start(self, shard: int) -> int:
        if shard == 0:
            return self.parallel.tp_rank * self.q_size
        return self.kv_head_start * self.head_dim

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
        super().weight_loader(param, loaded, index)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split along the vocabulary (padded to a multiple of tp_size).

    Each rank looks up the ids in its range, zeros the others, and the TP all-reduce
    assembles the full embedding.
    """

    def __init__(
        self, num_embeddings: int, dim: int, *, parallel: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = _param((self.per_rank, dim), dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if self.parallel.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: vocabulary {self.num_embeddings}, checkpoint "
                f"{tuple(loaded.shape)}"
            )
        n = self.vocab_end - self.vocab_start
        param.data.zero_()
        default_weight_loader(param.data[:n], loaded[self.vocab_start : self.vocab_end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection (vocab-parallel); may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return vocab_parallel_logits(hidden, self)


def vocab_parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """Full-vocabulary logits from a vocab-parallel weight: local slice, then all-gather."""
    logits = project(hidden, head.weight)
    if head.parallel.tp_size == 1:
        return logits
    return tp_all_gather_last_dim(logits, head.parallel)[..., : head.num_embeddings]


def use_input_major_weights(model: nn.Module) -> None:
    """Store every projection's weight input-major ([in, out] in memory), keeping its
    logical [out, in] shape: ``F.linear`` then hands the BLAS a plain ``x @ W`` instead
    of ``x @ W^T``. On CPU (MKL) that is up to 2x faster at decode batch sizes when the
    weight is in cache (a 16 x 256 x 2048 projection: 63 vs 127 us) and no slower for
    prefill chunks. Call after the weights are loaded; parameter names, shapes and
    values are unchanged. A head tied to the embedding keeps the row-major layout the
    embedding lookup wants.
    """
    for module in projections(model):
        module.weight.data = module.weight.data.t().contiguous().t()


def projections(model: nn.Module) -> list[nn.Module]:
    """The modules whose weight multiplies activations: the linear layers and an untied
    LM head (a tied head is the embedding itself)."""
    kinds = ColumnParallelLinear | RowParallelLinear | ParallelLMHead
    return [m for m in model.modules() if isinstance(m, kinds)]


def projection_bytes(model: nn.Module) -> int:
    """Bytes held by the projection weights."""
    return sum(m.weight.numel() * m.weight.element_size() for m in projections(model))


def use_float32_projections(model: nn.Module) -> None:
    """Store a bfloat16/float16 model's projection weights (and an untied LM head) in
    float32, with the same values; activations, norms, the embedding and the KV cache keep
    the model's dtype, and ``project`` rounds each output back to it.

    Half-precision values multiply exactly in float32 and the GEMM accumulates in float32
    either way, so only the summation order can differ from a half-precision GEMM. On a
    CPU without AMX it is much faster: torch's bfloat16 GEMM converts in software, and a
    small model's projections ran 1.03-1.64x faster in float32 at 1 to 256 rows (1.3x or
    more except at 4 rows) on the 2-core AVX-512 machine in benchmarks/RESULTS.md, even
    at 1 row, where the float32 weights are twice the bytes to read. Costs the weights' size again in memory.
    """
    for module in projections(model):
        weight = module.weight
        if weight.dtype in (torch.bfloat16, torch.float16):
            weight.data = weight.data.float().t().contiguous().t()  # input-major too


class PPMissingLayer(nn.Identity):
    """Stands in for a layer that lives on another pipeline stage (no parameters)."""


def pp_layer_range(num_layers: int, parallel: ParallelContext) -> tuple[int, int]:
    """``[start, end)`` of the layers this pipeline stage runs (earlier stages take the
    remainder)."""
    if num_layers < parallel.pp_size:
        raise ValueError(
            f"pipeline_parallel_size {parallel.pp_size} exceeds the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, parallel.pp_size)
    start = parallel.pp_rank * base + min(parallel.pp_rank, extra)
    return start, start + base + (1 if parallel.pp_rank < extra else 0)


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (as the reference does) and cast back before scaling."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.kernels_for(x, self.weight)
        if kernels is not None and x.dim() == 2:
            return kernels.rms_norm(x, self.weight, self.eps)
        # F.rms_norm is one fused kernel (the hand-written form is ~50x slower on CPU).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the residual stream, updated in place where fused) and its
        norm: the reference's ``hidden = residual + hidden; norm(hidden)``."""
        kernels = cpu_kernels.kernels_for(x, residual, self.weight)
        if kernels is not None and x.dim() == 2 and residual.stride(-1) == 1:
            return kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self.forward(residual), residual


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype)
        self.bias = _param((dim,), dtype)
        for p in (self.weight, self.bias):
            p.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
