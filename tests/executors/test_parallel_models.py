"""Sharded models (TP=2, PP=2) compute what the unsharded model computes, every arch.

Two real ranks (an ``mp`` executor with a stub model runner, joined by gloo) build each
architecture from its checkpoint with their ParallelContext and run a forward pass; the
logits must match the single-rank model's within float tolerance (the all-reduce sums in
another order), and the greedy tokens must be equal.
"""

from __future__ import annotations

import json
import shutil
import sys

import cloudpickle
import msgspec
import numpy as np
import pytest
import torch

from enginecore.distributed import SINGLE_RANK
from enginecore.testing.executor_contract import STUB_RUNNER_REF
from enginecore_models.weight_loader import (
    iter_weights,
    load_hf_config,
    resolve_model_class,
)

# The ranks need not be able to import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def no_cache_context(model, n: int):
    """The reference backend's context for one fresh prompt of ``n`` tokens, no cache."""
    from enginecore.layers import AttentionContext
    from enginecore.layers.torch_attention import TorchAttentionBackend
    from enginecore.testing.attention_steps import spec_for_model

    backend = TorchAttentionBackend(spec_for_model(model, block_size=16))
    return AttentionContext(backend, backend.build_profile_metadata([n]))


IDS = [3, 17, 256, 1024, 4000, 8000, 5, 9, 12, 77, 300, 2]


def forward_logits(worker, path: str, ids: list[int], layout: str) -> np.ndarray | None:
    """Runs on each rank. layout "tp": the worker's own TP context; "pp": both ranks as
    two pipeline stages of one TP rank each (hidden states sent rank 0 -> rank 1)."""
    import torch
    import torch.distributed as dist

    from enginecore.distributed import ParallelContext
    from enginecore_models.weight_loader import (
        iter_weights,
        load_hf_config,
        resolve_model_class,
    )

    parallel = worker.parallel
    if layout == "pp":
        parallel = ParallelContext(
            rank=worker.rank, world_size=2, tp_rank=0, tp_size=1, pp_rank=worker.rank, pp_size=2
        )
    cfg = load_hf_config(path)
    model = resolve_model_class(cfg, worker.worker_spec.model_refs)(cfg, parallel, torch.float32)
    model.load_weights(iter_weights(path, cfg))
    n = len(ids)
    meta = no_cache_context(model, n)
    with torch.inference_mode():
        ids_t, pos = torch.tensor(ids), torch.arange(n)
        if layout == "pp":
            received = None
            if not parallel.is_first_pp_rank:
                received = torch.empty(n, model.hidden_size)
                dist.recv(received, src=0)
            hidden = model(ids_t, pos, None, meta, received)
            if not parallel.is_last_pp_rank:
                dist.send(hidden, dst=1)
                return None
        else:
            hidden = model(ids_t, pos, None, meta)
        return model.compute_logits(hidden).numpy()


@pytest.fixture(scope="module")
def two_ranks():
    from enginecore.config import make_config
    from enginecore.engine.components import resolve_components
    from enginecore.plugins import make_plugin_manager
    from enginecore_executors.multiproc import MultiprocExecutor

    config = make_config(model="stub", executor="mp", tensor_parallel_size=2)
    spec = resolve_components(config, make_plugin_manager()).worker_spec
    executor = MultiprocExecutor(
        config, msgspec.structs.replace(spec, model_runner_ref=STUB_RUNNER_REF)
    )
    yield executor
    executor.shutdown()


def reference_logits(path, model_refs) -> torch.Tensor:
    cfg = load_hf_config(path)
    model = resolve_model_class(cfg, model_refs)(cfg, SINGLE_RANK, torch.float32)
    model.load_weights(iter_weights(path, cfg))

    n = len(IDS)
    meta = no_cache_context(model, n)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(IDS), torch.arange(n), None, meta))


def _check(got: np.ndarray, want: torch.Tensor) -> None:
    got_t = torch.from_numpy(np.asarray(got))
    assert got_t.shape == want.shape
    torch.testing.assert_close(got_t, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_t.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module")
def tied_llama(tiny_llama, tmp_path_factory):
    """The tiny llama with its LM head tied to the embedding (as SmolLM2 is)."""
    path = tmp_path_factory.mktemp("tied") / "llama-tied"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_tp2_logits_match_tp1(two_ranks, checkpoint_factory, model_refs, arch) -> None:
    path = checkpoint_factory(arch)
    want = reference_logits(path, model_refs)
    rank0, rank1 = two_ranks.collective_rpc(forward_logits, args=(str(path), IDS, "tp"))
    _check(rank0, want)
    np.testing.assert_array_equal(rank0, rank1)  # every rank ends with the same logits


NEW_ARCHS = ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "gemma3", "phi3", "olmo2"]


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_newer_archs_shard_over_tp2_and_pp2(two_ranks, checkpoint_factory, model_refs, arch):
    """TP splits every expert's intermediate dimension (MoE), the heads and the QK norms;
    PP splits the two layers into two stages."""
    path = checkpoint_factory(arch)
    want = reference_logits(path, model_refs)
    rank0, rank1 = two_ranks.collective_rpc(forward_logits, args=(str(path), IDS, "tp"))
    _check(rank0, want)
    np.testing.assert_array_equal(rank0, rank1)
    first, last = two_ranks.collective_rpc(forward_logits, args=(str(path), IDS, "pp"))
    assert first is None
    torch.testing.assert_close(torch.from_numpy(np.asarray(last)), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", ["llama", "tied"])
def test_pp2_logits_match_single_stage(two_ranks, tiny_llama, tied_llama, model_refs, which):
    path = tied_llama if which == "tied" else tiny_llama
    want = reference_logits(path, model_refs)
    first, last = two_ranks.collective_rpc(forward_logits, args=(str(path), IDS, "pp"))
    assert first is None
    # One stage computes each layer: the same float ops in the same order as TP=1.
    torch.testing.assert_close(torch.from_numpy(np.asarray(last)), want, atol=1e-5, rtol=0)


def test_pp_stage_holds_only_its_layers(tiny_llama) -> None:
    from enginecore.distributed import ParallelContext
    from enginecore.layers import Attention, PPMissingLayer, pp_layer_range
    from enginecore_models.models.llama import LlamaForCausalLM

    cfg = load_hf_config(tiny_llama)  # 4 layers
    stage1 = ParallelContext(rank=1, world_size=2, pp_rank=1, pp_size=2)
    model = LlamaForCausalLM(cfg, stage1)
    assert model.model.embed_tokens is None and model.model.norm is not None
    assert [isinstance(layer, PPMissingLayer) for layer in model.model.layers] == [
        True,
        True,
        False,
        False,
    ]
    # This stage's attention layers are what its KV cache holds.
    assert len([m for m in model.modules() if isinstance(m, Attention)]) == 2
    ranges = [
        pp_layer_range(7, ParallelContext(rank=r, world_size=3, pp_rank=r, pp_size=3))
        for r in range(3)
    ]
    assert ranges == [(0, 3), (3, 5), (5, 7)]


def test_tp_that_does_not_divide_the_heads_is_a_clear_error(tiny_llama) -> None:
    from enginecore.distributed import ParallelContext
    from enginecore_models.models.llama import LlamaForCausalLM

    cfg = load_hf_config(tiny_llama)  # 4 heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by .*3"):
        LlamaForCausalLM(cfg, ParallelContext(rank=0, world_size=3, tp_size=3))


def test_kv_heads_are_replicated_when_fewer_than_tp(tiny_llama) -> None:
    from enginecore.distributed import ParallelContext
    from enginecore.layers import QKVParallelLinear

    # 4 query heads, 2 KV heads, tp=4: each rank one query head, KV heads shared in pairs.
    starts = []
    for r in range(4):
        layer = QKVParallelLinear(
            64,
            16,
            4,
            2,
            bias=False,
            parallel=ParallelContext(rank=r, world_size=4, tp_rank=r, tp_size=4),
            dtype=torch.float32,
        )
        assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
        starts.append(layer.kv_head_start)
    assert starts == [0, 0, 1, 1]
    full = torch.arange((4 + 2 + 2) * 16 * 64, dtype=torch.float32).view(-1, 64)
    _q, k, _v = full.split([64, 32, 32])
    layer.weight_loader(layer.weight, k, "k")  # rank 3 holds KV head 1
    torch.testing.assert_close(layer.weight.data[16:32], k[16:32])
