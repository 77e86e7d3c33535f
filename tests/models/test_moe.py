"""The MoE layer groups a step's tokens by expert: one GEMM pair per expert with work,
over exactly its tokens; results equal the per-token definition; TP shards split every
expert's intermediate dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from enginecore.distributed import ParallelContext
from enginecore.layers.moe import FusedMoE, expert_checkpoint_target, route

E, K, H, INTER = 4, 2, 32, 48


def _experts(parallel: ParallelContext = ParallelContext(), seed: int = 0) -> FusedMoE:
    torch.manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H) / H**0.5
    down = torch.randn(E, H, INTER) / INTER**0.5
    moe = FusedMoE(
        E, K, H, INTER, renormalize=True, hidden_act="silu", parallel=parallel, dtype=torch.float32
    )
    moe.w13_weight.weight_loader(moe.w13_weight, gate_up)
    moe.w2_weight.weight_loader(moe.w2_weight, down)
    moe.full = (gate_up, down)
    return moe


def _per_token(moe: FusedMoE, x: torch.Tensor, weights, ids) -> torch.Tensor:
    gate_up, down = moe.full
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, down[e])
    return out


def test_one_gemm_pair_per_expert_over_its_tokens(monkeypatch):
    moe = _experts()
    torch.manual_seed(1)
    x = torch.randn(64, H)
    # Route every token to experts 0 and 2 or 2 and 3: expert 1 gets nothing.
    ids = torch.tensor([[0, 2] if t % 2 else [3, 2] for t in range(64)])
    weights = torch.rand(64, K)
    rows_per_call = []
    real_linear = F.linear

    def counting(inp, weight, bias=None):
        rows_per_call.append(inp.shape[0])
        return real_linear(inp, weight, bias)

    monkeypatch.setattr(F, "linear", counting)
    got = moe.experts(x, weights, ids)
    monkeypatch.setattr(F, "linear", real_linear)
    # Experts 0, 2, 3 in order: gate/up then down each, over 32, 64 and 32 tokens.
    assert rows_per_call == [32, 32, 64, 64, 32, 32]
    torch.testing.assert_close(got, _per_token(moe, x, weights, ids), atol=1e-5, rtol=0)


def test_routing_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)
    w, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, probs[:, :2])
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w, probs[:, :2] / probs[:, :2].sum())


def test_tp_shards_sum_to_the_whole_layer():
    torch.manual_seed(2)
    x = torch.randn(10, H)
    weights, ids = route(torch.randn(10, E), K, renormalize=True)
    whole = _experts().experts(x, weights, ids)
    halves = [
        _experts(ParallelContext(rank=r, world_size=2, tp_rank=r, tp_size=2)) for r in range(2)
    ]
    assert halves[0].w13_weight.shape == (E, INTER, H)  # half of every expert's 2 * INTER rows
    summed = sum(h.experts(x, weights, ids) for h in halves)
    torch.testing.assert_close(summed, whole, atol=1e-5, rtol=0)


def test_checkpoint_names_of_every_expert_layout():
    assert expert_checkpoint_target("model.layers.3.mlp.experts.7.gate_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight",
        (7, "gate"),
    )
    assert expert_checkpoint_target("model.layers.0.mlp.experts.1.w2.weight") == (
        "model.layers.0.mlp.experts.w2_weight",
        (1, "down"),
    )
    assert expert_checkpoint_target("model.layers.0.mlp.experts.gate_up_proj") == (
        "model.layers.0.mlp.experts.w13_weight",
        None,
    )
    assert expert_checkpoint_target("model.layers.0.mlp.shared_expert.up_proj.weight") is None
