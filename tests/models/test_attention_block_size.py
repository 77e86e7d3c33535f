"""With ``block_size`` unset, ``auto`` judges each attention backend at the block size it
asks for (``default_block_size``) and the engine adopts the chosen one's: a backend that
reads only large pages (as ``flash_attn``, pages of 256) is picked and fed; one whose
block size is ruled out by a size the user set is never picked.

The large-page backend here is the ``torch`` backend behind a real plugin registration,
refusing pages that are not a multiple of 64 and asking for 64 (flash-attn itself needs a
GPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import enginecore
from enginecore import make_config
from enginecore.engine.components import resolve_components
from enginecore.engine.core import EngineCore
from enginecore.interfaces import AttentionSpec
from enginecore.layers.selection import registered_refs, select_attention_backend
from enginecore.layers.torch_attention import TorchAttentionBackend
from enginecore.plugins import make_plugin_manager
from enginecore.testing.attention_steps import make_batch, step_context
from enginecore_models.model_runner import TorchModelRunner

PAGE = 64


class LargePagesBackend(TorchAttentionBackend):
    """Reads pages of a multiple of 64 tokens only; preferred over every built-in."""

    name = "large_pages"
    priority = 100
    default_block_size = PAGE

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, *, by_name: bool = False) -> str | None:
        if spec.block_size % PAGE:
            return f"needs block_size a multiple of {PAGE} (it is {spec.block_size})"
        return super().unsupported_reason(spec, by_name=by_name)


class LargePagesPlugin:
    @staticmethod
    @enginecore.hookimpl
    def register_attention_backends(registry):
        registry.add("large_pages", LargePagesBackend)


def _host():
    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(LargePagesPlugin(), "large-pages")
    return host


def _spec(block_size: int) -> AttentionSpec:
    return AttentionSpec(
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
        block_size=block_size,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
    )


def test_auto_judges_each_backend_at_its_own_block_size():
    refs = {**registered_refs("attention_backend"), "large_pages": f"{__name__}:LargePagesBackend"}
    # Unset block size: the large-page backend is fed its 64 and wins on priority.
    chosen = select_attention_backend(_spec(16), refs, "auto", auto_block_size=True)
    assert chosen is LargePagesBackend
    # A block size the user set that it cannot read: never picked.
    assert select_attention_backend(_spec(16), refs, "auto") is not LargePagesBackend
    assert select_attention_backend(_spec(128), refs, "auto") is LargePagesBackend
    # Named, with the block size unset: judged at its own size too.
    named = select_attention_backend(_spec(16), refs, "large_pages", auto_block_size=True)
    assert named is LargePagesBackend
    # flash_attn asks for the page size flash-attn reads; the others for 16.
    from enginecore_attention.flash_attn_backend import FlashAttnBackend

    assert FlashAttnBackend.default_block_size == 256
    assert TorchAttentionBackend.default_block_size == 16
    reason = FlashAttnBackend.unsupported_reason(replace(_spec(256), device=torch.device("cuda")))
    assert reason is None or "block_size" not in reason  # 256 is never its objection


def test_the_runner_feeds_the_chosen_backend_its_block_size(tiny_llama):
    """The runner loads with the large-page backend, 64-token blocks, and computes the
    logits transformers does through them."""
    from transformers import AutoModelForCausalLM

    config = make_config(model=str(tiny_llama), dtype="float32")
    runner = TorchModelRunner(config, resolve_components(config, _host()).worker_spec)
    runner.load_model()
    assert runner.attn_backend.name == "large_pages"
    assert runner.block_size == runner.attn_backend.spec.block_size == PAGE
    runner.initialize_kv_cache(4)
    assert runner.kv_caches[0].shape[2] == PAGE
    ids = torch.tensor([3, 17, 256, 1024, 77, 5])
    ctx = step_context(runner.attn_backend, make_batch([len(ids)], [0], [[2, 0]], PAGE))
    with torch.inference_mode():
        got = runner.model.compute_logits(runner.model(ids, torch.arange(6), runner.kv_caches, ctx))
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("block_size", [None, 16])
def test_the_engine_adopts_the_backends_block_size(tiny_llama, block_size):
    """Unset: the engine, its scheduler and what it reports use the backend's 64; set to
    16: the large-page backend is passed over and 16 is kept."""
    config = make_config(
        model=str(tiny_llama), dtype="float32", block_size=block_size, kv_cache_bytes=8 << 20
    )
    core = EngineCore(config, _host())
    try:
        want = PAGE if block_size is None else 16
        assert core.config.cache.block_size == want
        assert core.scheduler.block_size == want
        assert core.ready_response().block_size == want
        backend = core.executor.collective_rpc(_backend_name, unique_reply_rank=0)
        assert backend == ("large_pages" if block_size is None else "cpu")
    finally:
        core.shutdown()


def _backend_name(worker) -> str:
    return str(worker.model_runner.attn_backend.name)
