"""The dense decode mirror gives exactly the tokens plain paged attention gives.

Varied output lengths make requests leave the decode batch at different steps (rows are
swap-removed), a small max_num_seqs makes new ones join mid-way (rows are filled from the
paged cache), and a tight KV cache forces preemption (rows go stale). With a roomy cache
the mirror is allocated once at full size; with a tight one it grows step by step.
"""

from __future__ import annotations

import random

import pytest

from enginecore import LLM, SamplingParams
from enginecore_cpu import mirror_layout


@pytest.mark.parametrize("chunk_bytes", [None, 16 << 10], ids=["dense", "chunks"])
@pytest.mark.parametrize("tight_cache", [True, False], ids=["growing", "full-size"])
def test_mirror_matches_plain_paged_attention_under_churn(
    tiny_llama, tight_cache, chunk_bytes, monkeypatch
) -> None:
    """``chunks``: the mirror in chunks of 32 positions (``mirror_layout``), so that rows
    filled, moved, regrown and appended to span several."""
    if chunk_bytes is not None:
        monkeypatch.setattr(mirror_layout, "CHUNK_BYTES", chunk_bytes)
    rng = random.Random(11)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(rng.randint(3, 60))]}
        for _ in range(12)
    ]
    params = [
        SamplingParams(max_tokens=rng.randint(2, 30), temperature=0.0, ignore_eos=True)
        for _ in prompts
    ]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        max_num_seqs=5,
        num_blocks_override=14 if tight_cache else None,
        max_model_len=128,
    ) as llm:
        runner = llm.engine_client.engine.executor.worker.model_runner
        assert runner.attn_backend.mirror is not None  # on by default on CPU
        mirrored = llm.generate(prompts, params)
        mirror = runner.attn_backend.mirror
        assert mirror.layers, "the mirror was never used"
        assert (mirror.memory.layout.chunks > 1) == (chunk_bytes is not None)
        full_size = (5, 128)  # max_num_seqs rows, max_model_len positions
        if tight_cache:
            assert sum(o.metrics["num_preemptions"] for o in mirrored) > 0
            assert mirror._capacity() != full_size
        else:
            assert mirror._capacity() == full_size
        runner.attn_backend.mirror = None  # plain paged attention from here on
        plain = llm.generate(prompts, params)
    for a, b in zip(mirrored, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
