"""Linear layers sharded for tensor parallelism, each computed by a linear method.

Column-parallel layers split the output dimension across the TP ranks (no
communication); row-parallel layers split the input dimension and all-reduce their
partial outputs. A layer owns its sharding and its ``weight_loader``s; how its weight is
stored and multiplied belongs to its :class:`enginecore.interfaces.LinearMethod`
(``create_weights`` / ``process_weights_after_loading`` / ``apply``), chosen by the model
runner from ``model.linear_method`` and in force while the model is built
(:func:`use_linear_method`). A model never names a method: it builds these layers.

KV heads are split across ranks when there are at least ``tp_size`` of them; with fewer
(``num_kv_heads < tp_size``), each KV head is replicated on ``tp_size / num_kv_heads``
ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import ParallelContext
from enginecore.interfaces import LinearMethod
from enginecore.layers.contract_checks import check_linear_output
from enginecore.layers.parallel import divide, tp_all_reduce
from enginecore.layers.quantized import QuantizedTensor
from enginecore.layers.weights import default_weight_loader, make_param, set_weight_attrs


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model's dtype, multiplied by ``F.linear``: the reference on every
    device."""

    name = "unquantized"

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        weight = make_param((output_size, input_size), dtype)
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader})
        layer.weight = weight

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)


_CURRENT: contextvars.ContextVar[LinearMethod | None] = contextvars.ContextVar(
    "enginecore_linear_method", default=None
)


@contextlib.contextmanager
def use_linear_method(method: LinearMethod) -> Iterator[LinearMethod]:
    """Layers built inside this block store and multiply their weights with ``method``."""
    token = _CURRENT.set(method)
    try:
        yield method
    finally:
        _CURRENT.reset(token)


def current_linear_method() -> LinearMethod:
    method = _CURRENT.get()
    return method if method is not None else UnquantizedLinearMethod()


class LinearBase(nn.Module):
    """``y = x W^T + b`` on this rank's shard of W; subclasses decide the sharding."""

    weight: torch.Tensor  # made by the linear method's create_weights
    bias: nn.Parameter | None
    # LoRA adapters' weights for this projection (an enginecore.lora.layer.LoRALayer),
    # attached by the model runner when LoRA is enabled.
    lora: Any = None

    def __init__(
        self, input_size: int, output_size: int, *, bias_size: int | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.linear_method = current_linear_method()
        self.linear_method.create_weights(self, input_size, output_size, dtype)
        self.bias = None
        if bias_size is not None:
            self.bias = make_param((bias_size,), dtype)
            set_weight_attrs(self.bias, {"weight_loader": self.bias_loader})

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        raise NotImplementedError

    def bias_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        self.weight_loader(param, loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.linear_method.apply(self, x, self.bias)
        check_linear_output(self, x, output)
        if self.lora is not None:
            output = self.lora.add_delta(x, output)
        return output


class ColumnParallelLinear(LinearBase):
    """W (and b) split along the output dim across TP ranks; the output is this rank's
    slice (the next layer is row-parallel and consumes it)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features
        self.out_local = divide(out_features, parallel.tp_size, "output features")
        super().__init__(
            in_features, self.out_local, bias_size=self.out_local if bias else None, dtype=dtype
        )

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        rank = self.parallel.tp_rank
        default_weight_loader(param, loaded.narrow(0, rank * self.out_local, self.out_local))


class RowParallelLinear(LinearBase):
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
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features
        self.in_local = divide(in_features, parallel.tp_size, "input features")
        super().__init__(
            self.in_local, out_features, bias_size=out_features if bias else None, dtype=dtype
        )

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        rank = self.parallel.tp_rank
        default_weight_loader(param, loaded.narrow(1, rank * self.in_local, self.in_local))

    def bias_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear_method.apply(self, x)
        check_linear_output(self, x, partial)
        if self.lora is not None:  # a partial delta, summed by the all-reduce as the base
            partial = self.lora.add_delta(x, partial)
        out = tp_all_reduce(partial, self.parallel)
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input fused into one matmul (e.g. gate and up).

    Each projection is split across ranks on its own, so a rank holds
    ``[gate_slice; up_slice]``. Checkpoints store them separately;
    ``weight_loader(param, tensor, shard_index)`` writes each into its rows, and
    ``shard=None`` takes one tensor holding all of them back to back (GPT-2's c_attn).

    ``gated=True`` declares two equal halves that feed ``act(gate) * up``
    (:meth:`silu_and_mul`): a linear method may then compute the activation as it stores
    the product.
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
        gated: bool = False,
    ) -> None:
        self.output_sizes = list(output_sizes)
        if local_sizes is None:
            local_sizes = [divide(n, parallel.tp_size, "output features") for n in output_sizes]
        self.local_sizes = list(local_sizes)
        if gated and (len(self.local_sizes) != 2 or self.local_sizes[0] != self.local_sizes[1]):
            raise ValueError(f"a gated projection needs two equal halves, not {local_sizes}")
        self.gated = gated
        self.parallel = parallel
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.out_local = sum(self.local_sizes)
        self.output_offsets = [0, *_cumsum(self.local_sizes)]
        LinearBase.__init__(
            self,
            in_features,
            self.out_local,
            bias_size=self.out_local if bias else None,
            dtype=dtype,
        )
        # load_params checks that every shard of a fused parameter was loaded.
        for p in (self.weight, self.bias):
            if p is not None:
                set_weight_attrs(p, {"num_shards": len(output_sizes)})

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

    def fused_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gated projection of ``x`` in one pass, where the
        linear method computes the activation as it stores; None elsewhere (project,
        then apply :class:`enginecore.layers.SiluAndMul`, as in a step with LoRA)."""
        if self.lora is not None and self.lora.active:
            return None
        output: torch.Tensor | None = self.linear_method.apply_silu_and_mul(self, x, self.bias)
        return output


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


def quantized_shard_rows(
    layer: LinearBase, loaded: QuantizedTensor, shard: Any = None
) -> list[tuple[int, QuantizedTensor]]:
    """The rows of a checkpoint's quantized tensor ``loaded`` (or of its ``shard`` of a
    fused layer) that this rank's ``layer`` holds, each with the first output row it
    fills: a linear method that keeps blocks places them as ``weight_loader`` places a
    float tensor's rows. Raises ``ValueError`` when the inputs do not match."""
    if isinstance(layer, MergedColumnParallelLinear):
        if shard is None:  # the whole fused tensor: each shard in turn
            pieces: list[tuple[int, QuantizedTensor]] = []
            start = 0
            for index, size in enumerate(layer.output_sizes):
                pieces += quantized_shard_rows(layer, loaded.rows(start, size), index)
                start += size
            return pieces
        index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
        first = layer.output_offsets[index]
        length = layer.output_offsets[index + 1] - first
        pieces = [(first, loaded.rows(layer.shard_start(index), length))]
    elif isinstance(layer, ColumnParallelLinear):
        tp_rank = layer.parallel.tp_rank
        pieces = [(0, loaded.rows(tp_rank * layer.out_local, layer.out_local))]
    else:
        pieces = [(0, loaded)]
    for _, piece in pieces:
        if piece.shape[1] != layer.input_size:
            raise ValueError(
                f"shape mismatch: parameter has {layer.input_size} inputs, checkpoint "
                f"{piece.shape[1]}"
            )
    return pieces
