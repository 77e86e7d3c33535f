"""Mixture-of-experts MLP: a top-k router and experts whose GEMMs run grouped by expert.

One step's routed tokens are sorted by expert, so each expert with work runs one
``[its tokens, hidden]`` GEMM pair per step (the loop is over experts, never tokens, and
an expert that got no token costs nothing); the outputs are weighted and summed back
into their tokens with one ``index_add_``. Nothing computes every expert over every
token.

That loop needs each expert's token count on the host (one sync per layer), which a CUDA
graph cannot capture and which stalls a GPU's queue. On a GPU (``grouping == "device"``,
chosen where the layer is built on CUDA with Triton importable) the experts run from
``moe_grouped``: tokens grouped on the device in fixed-shape tiles and multiplied by a
Triton grouped GEMM (``enginecore.layers.moe_kernels``), with no host sync. The CPU keeps
the loop, which is faster there.

Tensor parallelism shards every expert's intermediate dimension across the TP ranks (as
the dense MLP's column/row split): each rank holds ``[E, 2 * I / tp, H]`` and
``[E, H, I / tp]`` and the partial outputs are all-reduced once.

Checkpoints store experts per expert (``experts.{e}.gate_proj`` / ``w1``...) or, as
transformers 5 does in memory, fused (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); both load (``expert_checkpoint_target``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import ParallelContext
from enginecore.layers.activation import act_and_mul, get_activation
from enginecore.layers.parallel import divide, tp_all_reduce
from enginecore.layers.weights import default_weight_loader, set_weight_attrs


def default_grouping(device: torch.device) -> str:
    """How experts on ``device`` group their tokens: ``"device"`` (``moe_grouped``: no host
    sync, capture-safe) on CUDA/ROCm with Triton importable, else ``"loop"`` (each expert's
    count on the host, one GEMM pair per expert with work: the CPU's faster path)."""
    if device.type != "cuda":
        return "loop"
    try:
        import enginecore.layers.moe_kernels  # noqa: F401  (the kernel needs triton)
    except ImportError:
        return "loop"
    return "device"


# checkpoint projection of one expert -> (fused parameter, part)
_EXPERT_PROJECTIONS = {
    "gate_proj": ("w13_weight", "gate"),
    "w1": ("w13_weight", "gate"),
    "up_proj": ("w13_weight", "up"),
    "w3": ("w13_weight", "up"),
    "down_proj": ("w2_weight", "down"),
    "w2": ("w2_weight", "down"),
}
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def expert_checkpoint_target(name: str) -> tuple[str, Any] | None:
    """``(parameter name, shard)`` of an expert weight in a checkpoint, None for any other
    tensor. The shard is ``(expert, part)``, or None for a fused all-experts tensor."""
    match = _PER_EXPERT.match(name)
    if match and match.group(3) in _EXPERT_PROJECTIONS:
        param, part = _EXPERT_PROJECTIONS[match.group(3)]
        return f"{match.group(1)}.{param}", (int(match.group(2)), part)
    match = _FUSED.match(name)
    if match:
        param = "w13_weight" if match.group(2) == "gate_up_proj" else "w2_weight"
        return f"{match.group(1)}.{param}", None
    return None


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert ids)``, both [T, top_k]: softmax over the experts (in float32),
    the top k, rescaled to sum to one when ``renormalize`` (Mixtral always, Qwen MoE as
    ``norm_topk_prob`` says)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Router(nn.Module):
    """The replicated gate: hidden -> one logit per expert."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """The experts of one layer; ``forward(x, router_logits)`` routes and computes."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        hidden_act: str,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.parallel = parallel
        self.intermediate = intermediate_size
        self.local = divide(intermediate_size, parallel.tp_size, "moe intermediate size")
        self.activation = get_activation(hidden_act)
        self.grouping = default_grouping(torch.get_default_device())
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.local, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local, dtype=dtype), requires_grad=False
        )
        # load_params checks that every expert's every part was loaded.
        set_weight_attrs(
            self.w13_weight, {"num_shards": 2 * num_experts, "weight_loader": self._load_w13}
        )
        set_weight_attrs(
            self.w2_weight, {"num_shards": num_experts, "weight_loader": self._load_w2}
        )

    # --- loading ------------------------------------------------------------------------

    def _rows(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of an expert's intermediate dimension."""
        if full.shape[dim] != self.intermediate:
            raise ValueError(
                f"shape mismatch: expert intermediate size {self.intermediate}, "
                f"checkpoint {tuple(full.shape)}"
            )
        return full.narrow(dim, self.parallel.tp_rank * self.local, self.local)

    def _load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:  # [E, 2I, H]: every expert's gate then up
            for e in range(self.num_experts):
                gate, up = torch.split(loaded[e], self.intermediate, dim=0)
                self._load_w13(param, gate, (e, "gate"))
                self._load_w13(param, up, (e, "up"))
            return
        expert, part = shard
        start = 0 if part == "gate" else self.local
        default_weight_loader(param.data[expert, start : start + self.local], self._rows(loaded, 0))

    def _load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:  # [E, H, I]
            for e in range(self.num_experts):
                self._load_w2(param, loaded[e], (e, "down"))
            return
        default_weight_loader(param.data[shard[0]], self._rows(loaded, 1))

    # --- the step -----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], summed over the TP ranks."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        return tp_all_reduce(out, self.parallel)

    def cuda_graph_blocker(self) -> str | None:
        """Why a CUDA graph cannot capture this layer (None: it can)."""
        if self.grouping == "device":
            return None
        return (
            "the MoE layer groups tokens by expert on the host (its 'loop' grouping syncs "
            "once per layer); the capture-safe 'device' grouping needs Triton"
        )

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``."""
        if self.grouping == "device":
            from enginecore.layers.moe_grouped import grouped_experts

            return grouped_experts(
                x, weights, ids, self.w13_weight, self.w2_weight, self.num_experts, self.activation
            )
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one sync
        grouped = x.index_select(0, tokens)
        results = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate_up = F.linear(grouped[rows], self.w13_weight[expert])
            results[rows] = F.linear(act_and_mul(self.activation, gate_up), self.w2_weight[expert])
            start += count
        scale = weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        return out.index_add_(0, tokens, (results * scale).to(x.dtype))


class SparseMoeBlock(nn.Module):
    """A layer's MoE MLP as Mixtral and the Qwen MoE models name it: ``gate`` (the router)
    and ``experts``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        hidden_act: str,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, dtype)
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize=renormalize,
            hidden_act=hidden_act,
            parallel=parallel,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.experts(x, self.gate(x))
        return output
